"""Learning-rate schedules: callables of the optimizer step.

Pass any of them as ``learning_rate=`` to a rule of
:mod:`lasagne_accum.updates`: the rule then owns an int64 step counter
(``adamw.schedule_step``), evaluates the schedule on it symbolically, and
advances it once per optimizer step (once per apply in the two-function
form, once per stepping call with ``average=N``), never per mini-batch.

Every schedule takes ``unit="steps"`` (default) or ``unit="examples"``: keyed
in examples, the rule's counter advances by each window's total weight (the
rule must be given ``accu.grads`` of ``accumulate_gradients(..., weight=...)``),
so that a schedule stays where it was meant to be in the data when the batch
size changes during training (a batch-size ramp through
``compile_accumulation(every=callable)``); its arguments (``warmup_steps``,
``decay_steps``, boundaries) then count examples.

Every schedule here has the definition and the argument meanings of optax's
schedule of the same purpose (``optax.constant_schedule``,
``optax.linear_schedule``, ``optax.cosine_decay_schedule``,
``optax.warmup_cosine_decay_schedule``, ``optax.piecewise_constant_schedule``,
``optax.exponential_decay``), and works both on a symbolic step (returning a
float64 expression of the step's shape) and on a Python or numpy integer
(returning a Python float). Schedules are small picklable objects, so they can
travel to parameter-server workers.

:func:`linear_scaling` is Goyal et al.'s rule for the learning rate of a
larger batch; it scales a number or a schedule.

Deliberate differences from optax:

* Where optax logs a message and falls back (a non-positive
  ``transition_steps`` gives a constant schedule, a negative
  ``transition_begin`` is taken as 0), the same fallback happens here, silently.
* ``warmup_cosine_decay`` checks ``decay_steps > warmup_steps`` itself and
  names both arguments (optax raises from the inner cosine schedule).
* Hyperparameters must be finite Python numbers (optax also takes arrays).
* Values are float64 here. optax evaluates a schedule on its int32 step
  count, on which several of its schedules return float32 values even with
  ``jax_enable_x64`` (a relative difference of about 1e-8); given an int64
  step, optax's values equal these to rounding (the tests check 1e-12).
"""

from __future__ import annotations

import numbers
from typing import TYPE_CHECKING, Any, Callable, Mapping, overload

import numpy as np
import pytensor.tensor as pt
from pytensor.graph.basic import Variable

from ._checks import check_integer, check_number, check_range


def _unit(unit: Any) -> str:
    """A schedule's `unit`: ``"steps"`` (its argument counts optimizer steps) or ``"examples"``."""
    if unit not in ("steps", "examples"):
        raise ValueError(f"unit must be 'steps' or 'examples', got {unit!r}")
    return unit


def _steps(value: Any, name: str, **bounds: Any) -> int:
    """A number of steps (or examples): an integer, or a float with an integral value."""
    return check_range(check_integer(value, name, integral_float=True), name, **bounds)

if TYPE_CHECKING:
    from pytensor.tensor.variable import TensorVariable

__all__ = [
    "Schedule",
    "constant",
    "linear_warmup",
    "cosine_decay",
    "warmup_cosine_decay",
    "piecewise_constant",
    "exponential_decay",
    "linear_scaling",
    "sqrt_scaling",
]


class _Ops:
    """The few operations the schedules need: numpy's on numbers, PyTensor's on expressions.

    `where` is ``np.where`` or ``pt.switch``; `as_float` casts the step to float64.
    """

    def __init__(self, lib, where, as_float):
        self.where, self.as_float = where, as_float
        self.minimum, self.maximum, self.clip = lib.minimum, lib.maximum, lib.clip
        self.cos, self.floor, self.power, self.sign = lib.cos, lib.floor, lib.power, lib.sign


_NUMPY_OPS = _Ops(np, np.where, lambda step: np.asarray(step, dtype="float64"))
_SYMBOLIC_OPS = _Ops(pt, pt.switch, lambda step: pt.cast(step, "float64"))


class Schedule:
    """Base class: a callable of the optimizer step.

    Subclasses implement ``_value(step, ops)`` with the operations of `ops`
    (numpy or PyTensor) on a float64 `step`. Calling the schedule with a
    symbolic step returns a float64 expression; with a Python/numpy number
    (or array) it returns a Python float (or a float64 array).
    """

    @overload
    def __call__(self, step: float) -> float: ...
    @overload
    def __call__(self, step: np.ndarray) -> np.ndarray: ...
    @overload
    def __call__(self, step: Variable) -> TensorVariable: ...

    def __call__(self, step: Any) -> Any:  # typed by the overloads above
        if isinstance(step, Variable):
            dtype = getattr(step.type, "dtype", "")
            if not (dtype.startswith("int") or dtype.startswith("uint")
                    or dtype.startswith("float")):
                raise TypeError(f"step must be a numeric expression, got {step.type}")
            out = self._value(_SYMBOLIC_OPS.as_float(step), _SYMBOLIC_OPS)
            out = pt.as_tensor_variable(out)
            if out.type.dtype != "float64":
                out = pt.cast(out, "float64")
            # Constant parts of a schedule still take the step's shape.
            if out.type.ndim < step.type.ndim:
                out = out + pt.zeros_like(step, dtype="float64")
            return out
        if isinstance(step, (bool, np.bool_)):
            raise TypeError("step must be a number or a symbolic scalar, got a bool")
        if isinstance(step, (numbers.Real, np.number)) or isinstance(step, np.ndarray):
            out = np.asarray(self._value(_NUMPY_OPS.as_float(step), _NUMPY_OPS), dtype="float64")
            if np.ndim(step) > 0:  # type: ignore[arg-type]  # numbers.Real is not ArrayLike
                return out + np.zeros(np.shape(step))  # type: ignore[arg-type]
            return float(out)
        raise TypeError(
            f"step must be a number or a symbolic scalar, got {type(step).__name__}"
        )

    def _value(self, step, ops):  # pragma: no cover - abstract
        raise NotImplementedError

    def __repr__(self):
        args = ", ".join(f"{k}={v!r}" for k, v in self.__dict__.items())
        return f"{type(self).__name__}({args})"


class constant(Schedule):
    """A schedule that always returns `value` (``optax.constant_schedule``).

    * ``lr(step) = value``

    Parameters
    ----------
    value : float
        The learning rate at every step.

    Examples
    --------
    >>> constant(0.1)(0), constant(0.1)(1000)
    (0.1, 0.1)
    """

    def __init__(self, value: float, *, unit: str = "steps") -> None:
        self.value = check_number(value, "value")
        self.unit = _unit(unit)

    def _value(self, step, ops):
        return self.value


class linear_warmup(Schedule):
    """Linear ramp from `init_value` to `peak_value` (``optax.linear_schedule``).

    With ``B = transition_begin`` and ``T = warmup_steps``:

    * ``c = clip(step - B, 0, T)``
    * ``lr(step) = (init_value - peak_value) * (1 - c / T) + peak_value``

    so the rate is `init_value` up to step B, reaches `peak_value` at step
    B + T and stays there (optax's ``warmup_constant_schedule`` when B = 0).

    Parameters
    ----------
    init_value : float
        Rate at steps 0..B.
    peak_value : float
        Rate from step B + T on (optax's ``end_value``; it may be smaller
        than `init_value`, for a linear decay).
    warmup_steps : int
        Length T of the ramp (optax's ``transition_steps``). As in optax,
        ``T <= 0`` gives the constant schedule `init_value`.
    transition_begin : int
        Steps B to hold `init_value` before the ramp starts. Default 0; a
        negative value is taken as 0, as in optax.

    Examples
    --------
    >>> s = linear_warmup(0.0, 1.0, warmup_steps=4)
    >>> [s(k) for k in range(6)]
    [0.0, 0.25, 0.5, 0.75, 1.0, 1.0]
    """

    def __init__(
        self,
        init_value: float,
        peak_value: float,
        warmup_steps: int,
        transition_begin: int = 0,
        *,
        unit: str = "steps",
    ) -> None:
        self.unit = _unit(unit)
        self.init_value = check_number(init_value, "init_value")
        self.peak_value = check_number(peak_value, "peak_value")
        self.warmup_steps = _steps(warmup_steps, "warmup_steps")
        self.transition_begin = max(
            _steps(transition_begin, "transition_begin"), 0)

    def _value(self, step, ops):
        if self.warmup_steps <= 0:
            return self.init_value
        count = ops.clip(step - self.transition_begin, 0, self.warmup_steps)
        frac = 1 - count / self.warmup_steps
        return (self.init_value - self.peak_value) * frac + self.peak_value


class cosine_decay(Schedule):
    """Cosine decay from `init_value` (``optax.cosine_decay_schedule``).

    With ``T = decay_steps``:

    * ``c = min(step, T)``
    * ``d = (1 - alpha) * (0.5 * (1 + cos(pi * c / T))) ** exponent + alpha``
    * ``lr(step) = init_value * d``

    Parameters
    ----------
    init_value : float
        Rate at step 0.
    decay_steps : int
        Steps T over which the rate falls to ``alpha * init_value``; must be
        positive.
    alpha : float
        Final rate as a fraction of `init_value`. Default 0.
    exponent : float
        Power of the cosine factor. Default 1.

    Raises
    ------
    ValueError
        If `decay_steps` <= 0.

    Examples
    --------
    >>> s = cosine_decay(1.0, decay_steps=4)
    >>> [round(s(k), 6) for k in range(6)]
    [1.0, 0.853553, 0.5, 0.146447, 0.0, 0.0]
    """

    def __init__(
        self,
        init_value: float,
        decay_steps: int,
        alpha: float = 0.0,
        exponent: float = 1.0,
        *,
        unit: str = "steps",
    ) -> None:
        self.unit = _unit(unit)
        self.init_value = check_number(init_value, "init_value")
        self.decay_steps = _steps(decay_steps, "decay_steps", low=0,
                                   low_open=True)
        self.alpha = check_number(alpha, "alpha")
        self.exponent = check_number(exponent, "exponent")

    def _value(self, step, ops):
        count = ops.minimum(step, float(self.decay_steps))
        cosine = 0.5 * (1 + ops.cos(np.pi * count / self.decay_steps))
        decayed = (1 - self.alpha) * cosine ** self.exponent + self.alpha
        return self.init_value * decayed


class warmup_cosine_decay(Schedule):
    """Linear warmup then cosine decay (``optax.warmup_cosine_decay_schedule``).

    With ``W = warmup_steps`` and ``T = decay_steps`` (T counts the warmup,
    as in optax):

    * ``lr(step) = linear_warmup(init_value, peak_value, W)(step)`` for step < W
    * ``lr(step) = cosine_decay(peak_value, T - W, end_value / peak_value,
      exponent)(step - W)`` from step W on (``alpha = 0`` when
      ``peak_value == 0``)

    Parameters
    ----------
    init_value : float
        Rate at step 0.
    peak_value : float
        Rate at the end of the warmup, step W.
    warmup_steps : int
        Length W of the linear warmup (>= 0).
    decay_steps : int
        Total length T of the schedule, warmup included: the cosine part
        lasts ``T - W`` steps, so T must exceed W.
    end_value : float
        Rate from step T on. Default 0.
    exponent : float
        Power of the cosine factor. Default 1.

    Raises
    ------
    ValueError
        If `warmup_steps` < 0 or `decay_steps` <= `warmup_steps` (the warmup
        would be longer than the whole schedule).

    Examples
    --------
    >>> s = warmup_cosine_decay(0.0, 1.0, warmup_steps=2, decay_steps=6)
    >>> [round(s(k), 6) for k in range(8)]
    [0.0, 0.5, 1.0, 0.853553, 0.5, 0.146447, 0.0, 0.0]
    """

    def __init__(
        self,
        init_value: float,
        peak_value: float,
        warmup_steps: int,
        decay_steps: int,
        end_value: float = 0.0,
        exponent: float = 1.0,
        *,
        unit: str = "steps",
    ) -> None:
        self.unit = _unit(unit)
        self.init_value = check_number(init_value, "init_value")
        self.peak_value = check_number(peak_value, "peak_value")
        self.warmup_steps = _steps(warmup_steps, "warmup_steps", low=0)
        self.decay_steps = _steps(decay_steps, "decay_steps")
        self.end_value = check_number(end_value, "end_value")
        self.exponent = check_number(exponent, "exponent")
        if self.decay_steps <= self.warmup_steps:
            raise ValueError(
                f"warmup_steps ({self.warmup_steps}) must be smaller than decay_steps "
                f"({self.decay_steps}): decay_steps is the length of the whole schedule, "
                "warmup included (optax's meaning); the cosine part lasts "
                "decay_steps - warmup_steps steps"
            )

    def _value(self, step, ops):
        warm = linear_warmup(self.init_value, self.peak_value, self.warmup_steps)
        alpha = 0.0 if self.peak_value == 0.0 else self.end_value / self.peak_value
        decay = cosine_decay(self.peak_value, self.decay_steps - self.warmup_steps, alpha,
                             self.exponent)
        return ops.where(step < self.warmup_steps, warm._value(step, ops),
                         decay._value(step - self.warmup_steps, ops))


class piecewise_constant(Schedule):
    """Scaled jumps at given steps (``optax.piecewise_constant_schedule``).

    * ``lr(step) = init_value * prod(scale for boundary, scale in
      boundaries_and_scales.items() if step >= boundary)``

    Parameters
    ----------
    init_value : float
        Rate before the first boundary.
    boundaries_and_scales : dict of int to float, optional
        ``{step: scale}``: from `step` on, the rate is multiplied by `scale`
        (>= 0). None or empty: a constant schedule.

    Raises
    ------
    ValueError
        If a scale is negative.

    Examples
    --------
    >>> s = piecewise_constant(1.0, {3: 0.5, 5: 0.1})
    >>> [round(s(k), 6) for k in range(7)]
    [1.0, 1.0, 1.0, 0.5, 0.5, 0.05, 0.05]
    """

    def __init__(
        self,
        init_value: float,
        boundaries_and_scales: Mapping[int, float] | None = None,
        *,
        unit: str = "steps",
    ) -> None:
        self.unit = _unit(unit)
        self.init_value = check_number(init_value, "init_value")
        if boundaries_and_scales is None:
            boundaries_and_scales = {}
        if not hasattr(boundaries_and_scales, "items"):
            raise TypeError(
                "boundaries_and_scales must be a dict {step: scale}, got "
                f"{type(boundaries_and_scales).__name__}"
            )
        checked = {}
        for boundary, scale in boundaries_and_scales.items():
            boundary = _steps(boundary, "a boundary of boundaries_and_scales")
            checked[boundary] = check_number(scale, f"boundaries_and_scales[{boundary}]", low=0)
        self.boundaries_and_scales = dict(sorted(checked.items()))

    def _value(self, step, ops):
        value = self.init_value
        for boundary, scale in self.boundaries_and_scales.items():
            below = ops.maximum(0.0, ops.sign(boundary - step))
            value = value * below + (1 - below) * scale * value
        return value


class exponential_decay(Schedule):
    """Continuous or staircase exponential decay (``optax.exponential_decay``).

    With ``B = transition_begin`` and ``T = transition_steps``:

    * ``p = (step - B) / T``, rounded down when `staircase`
    * ``lr(step) = init_value`` for step <= B, else
      ``init_value * decay_rate ** p``
    * clipped at `end_value` (a lower bound when ``decay_rate < 1``, an upper
      bound otherwise) if given

    Parameters
    ----------
    init_value : float
        Rate up to step B.
    transition_steps : int
        Steps T per factor `decay_rate`. As in optax, ``T <= 0`` gives the
        constant schedule `init_value`.
    decay_rate : float
        Factor per T steps. As in optax, 0 gives the constant schedule
        `init_value`.
    transition_begin : int
        Steps B to hold `init_value`. Default 0 (negative: taken as 0).
    staircase : bool
        Decay in whole factors every T steps. Default False.
    end_value : float, optional
        The bound at which the decay stops.

    Examples
    --------
    >>> s = exponential_decay(1.0, transition_steps=2, decay_rate=0.5)
    >>> [round(s(k), 6) for k in range(5)]
    [1.0, 0.707107, 0.5, 0.353553, 0.25]
    >>> s = exponential_decay(1.0, 2, 0.5, staircase=True, end_value=0.3)
    >>> [round(s(k), 6) for k in range(5)]
    [1.0, 1.0, 0.5, 0.5, 0.3]
    """

    def __init__(
        self,
        init_value: float,
        transition_steps: int,
        decay_rate: float,
        transition_begin: int = 0,
        staircase: bool = False,
        end_value: float | None = None,
        *,
        unit: str = "steps",
    ) -> None:
        self.unit = _unit(unit)
        self.init_value = check_number(init_value, "init_value")
        self.transition_steps = _steps(transition_steps, "transition_steps")
        self.decay_rate = check_number(decay_rate, "decay_rate")
        self.transition_begin = max(
            _steps(transition_begin, "transition_begin"), 0)
        self.staircase = bool(staircase)
        self.end_value = None if end_value is None else check_number(end_value, "end_value")

    def _value(self, step, ops):
        if self.transition_steps <= 0 or self.decay_rate == 0:
            return self.init_value
        decreased = step - self.transition_begin
        p = decreased / self.transition_steps
        if self.staircase:
            p = ops.floor(p)
        value = ops.where(decreased <= 0, self.init_value,
                          self.init_value * ops.power(self.decay_rate, p))
        if self.end_value is not None:
            clip = ops.maximum if self.decay_rate < 1.0 else ops.minimum
            value = clip(value, self.end_value)
        return value


class _Scaled(Schedule):
    """A schedule times a constant `factor`; with `batch_power`, the rule also multiplies
    it by ``(B / base_batch_size) ** batch_power``, B the window's run-time batch."""

    def __init__(self, schedule, factor, base_batch_size=None, batch_power=None):
        self.schedule, self.factor = schedule, factor
        self.base_batch_size, self.batch_power = base_batch_size, batch_power

    @property
    def unit(self):
        return getattr(self.schedule, "unit", "steps")

    def __call__(self, step):
        return self.schedule(step) * self.factor


def _batch_scaling(base_lr, base_batch_size, batch_size, power):
    """Both scaling rules: ``base_lr * (batch_size / base_batch_size) ** power``."""
    base_batch_size = _steps(base_batch_size, "base_batch_size", low=1)
    if batch_size is None:   # the window's batch, read by the rule at run time
        schedule = base_lr if callable(base_lr) else constant(
            check_number(base_lr, "base_lr", low=0))
        return _Scaled(schedule, 1.0, base_batch_size, power)
    batch_size = _steps(batch_size, "batch_size", low=1)
    factor = (batch_size / base_batch_size) ** power
    if callable(base_lr):
        return _Scaled(base_lr, factor)
    rate = check_number(base_lr, "base_lr", low=0)
    return rate * factor


@overload
def linear_scaling(base_lr: float, base_batch_size: int, batch_size: int) -> float: ...
@overload
def linear_scaling(
    base_lr: Callable[[Any], Any], base_batch_size: int, batch_size: int | None
) -> Schedule: ...
@overload
def linear_scaling(base_lr: float, base_batch_size: int, batch_size: None) -> Schedule: ...


def linear_scaling(
    base_lr: float | Callable[[Any], Any],
    base_batch_size: int,
    batch_size: int | None,
) -> float | Schedule:
    """The linear scaling rule of Goyal et al. [1]_ for a larger batch.

    * ``lr = base_lr * batch_size / base_batch_size``

    "When the minibatch size is multiplied by k, multiply the learning rate
    by k." The paper pairs it with a gradual warmup over the first epochs
    (:func:`linear_warmup`, :func:`warmup_cosine_decay`); with accumulation,
    `batch_size` is the effective batch (mini-batch times the number of
    accumulated calls).

    Parameters
    ----------
    base_lr : float or schedule
        The learning rate tuned for `base_batch_size`; a schedule is scaled at
        every step.
    base_batch_size : int
        The batch size `base_lr` was tuned for (>= 1).
    batch_size : int or None
        The (effective) batch size to train with (>= 1). None: the batch of
        each window at run time, the accumulation's total weight (a rule given
        ``accu.grads`` of ``accumulate_gradients(..., weight=...)``), so that
        the rate follows a batch-size schedule (``compile_accumulation(every=
        callable)``).

    Returns
    -------
    float or schedule
        The scaled learning rate, of the kind of `base_lr`; a schedule when
        `batch_size` is None.

    Raises
    ------
    ValueError
        If a batch size is < 1 or `base_lr` is negative.

    See Also
    --------
    sqrt_scaling : the square-root rule.

    References
    ----------
    .. [1] Goyal, P. et al. (2017): Accurate, Large Minibatch SGD: Training
       ImageNet in 1 Hour. arXiv:1706.02677.

    Examples
    --------
    >>> linear_scaling(0.1, 256, 8192)
    3.2
    >>> warm = linear_scaling(linear_warmup(0.0, 0.1, 5), 32, 512)
    >>> warm(0), warm(5)
    (0.0, 1.6)
    """
    return _batch_scaling(base_lr, base_batch_size, batch_size, 1.0)


@overload
def sqrt_scaling(base_lr: float, base_batch_size: int, batch_size: int) -> float: ...
@overload
def sqrt_scaling(
    base_lr: Callable[[Any], Any], base_batch_size: int, batch_size: int | None
) -> Schedule: ...
@overload
def sqrt_scaling(base_lr: float, base_batch_size: int, batch_size: None) -> Schedule: ...


def sqrt_scaling(
    base_lr: float | Callable[[Any], Any],
    base_batch_size: int,
    batch_size: int | None,
) -> float | Schedule:
    """The square-root scaling rule (Krizhevsky [1]_, Hoffer et al. [2]_) for a larger batch.

    * ``lr = base_lr * sqrt(batch_size / base_batch_size)``

    Keeps the variance of the update the same when the batch grows (the
    mean gradient's variance falls as ``1 / batch_size``), where
    :func:`linear_scaling` keeps the expected update per example the same.

    Parameters
    ----------
    base_lr, base_batch_size, batch_size
        As for :func:`linear_scaling` (None: each window's run-time batch).

    Returns
    -------
    float or schedule

    Raises
    ------
    ValueError
        If a batch size is < 1 or `base_lr` is negative.

    References
    ----------
    .. [1] Krizhevsky, A. (2014): One weird trick for parallelizing
       convolutional neural networks. arXiv:1404.5997.
    .. [2] Hoffer, E., Hubara, I. and Soudry, D. (2017): Train longer,
       generalize better. arXiv:1705.08741.

    Examples
    --------
    >>> sqrt_scaling(0.1, 64, 256)
    0.2
    """
    return _batch_scaling(base_lr, base_batch_size, batch_size, 0.5)
