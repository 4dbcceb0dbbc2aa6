"""Model averaging: PaddlePaddle's windowed ModelAverage, and an EMA.

Both keep averages of the parameters over optimizer steps, through an update
dictionary (``.updates``) that you merge into the function that takes the
optimizer step, and both swap the averages into the parameters for
evaluation with :meth:`apply` and put the trained values back, bit for bit,
from a backup copy with :meth:`restore`.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from typing import TYPE_CHECKING

import numpy as np
import pytensor.tensor as pt

from ._checks import check_int, check_params, param_label
from ._graph import as_host_array, guard_updates, hyperparameter, scalar_state, state_like, \
    write_value

if TYPE_CHECKING:
    from contextlib import AbstractContextManager
    from typing import Callable

    from pytensor.tensor.sharedvar import TensorSharedVariable
    from pytensor.graph.basic import Variable

    from ._typing import Params, Scalar, UpdatesLike

__all__ = ["ModelAverage", "ExponentialMovingAverage", "step_signal"]

_host = as_host_array


def step_signal(
    updates: UpdatesLike | None,
    params: Params,
    is_step: Variable | bool | None = None,
    who: str = "ModelAverage",
) -> Variable | None:
    """When does an optimizer step happen? The condition an average is gated by.

    Parameters
    ----------
    updates : dict or None
        The optimizer's update dictionary.
    params : list of shared variables
        The averaged parameters.
    is_step : symbolic boolean scalar, True or None
        Said explicitly: a symbolic condition (``upd.is_step`` of a
        single-function dictionary, ``accu.is_step`` of an accumulation), or
        True for "every call of the function is a step". None: read it from
        `updates`.
    who : str
        Named in error messages.

    Returns
    -------
    symbolic scalar or None
        None when every call is a step.

    Raises
    ------
    ValueError
        If the step signal of `updates` cannot be known: some parameters'
        new values carry a step signal and others do not, or they carry
        different ones (pass `is_step` explicitly), or `is_step` is False.
    TypeError
        If `is_step` is neither True, None nor a symbolic scalar.

    Notes
    -----
    The single-function form (``average=N``) and the rules given
    ``accu.grads`` record their step signal on each new value they return
    (``value.tag.step_signal``), so a plain copy of their dictionary
    (``dict(upd)``) keeps it: the average still advances on optimizer steps
    only. A dictionary whose values carry no signal is a plain rule's, whose
    every call is a step.
    """
    if is_step is not None:
        if is_step is True:
            return None
        if isinstance(is_step, (bool, np.bool_, int, float)):
            raise ValueError(
                f"{who}: is_step must be a symbolic condition or True (every call is a "
                f"step), got {is_step!r}"
            )
        if not hasattr(is_step, "type") or getattr(is_step.type, "ndim", None) != 0:
            raise TypeError(
                f"{who}: is_step must be a symbolic scalar condition, got {is_step!r}"
            )
        return is_step
    if updates is None:
        return None
    signals = [getattr(getattr(updates[p], "tag", None), "step_signal", None) for p in params]
    declared = getattr(updates, "is_step", None)
    distinct = {id(sig): sig for sig in signals if sig is not None}
    if declared is not None and set(distinct) <= {id(declared)}:
        return declared
    if not distinct:
        return None
    if len(distinct) == 1 and all(sig is not None for sig in signals):
        return next(iter(distinct.values()))
    untagged = [param_label(p, i) for i, (p, sig) in enumerate(zip(params, signals))
                if sig is None]
    detail = (f"the new values of {', '.join(untagged)} carry none while others do"
              if untagged else "the parameters' new values carry different step signals")
    raise ValueError(
        f"{who}: cannot tell from updates when an optimizer step happens ({detail}); "
        "pass is_step= explicitly (upd.is_step of a single-function dictionary, "
        "accu.is_step of an accumulation, or True if every call is a step)"
    )


class _SwappableAverage:
    """apply()/restore() over averages computed by a subclass's `_averages()`."""

    # set by the subclasses
    num_updates: TensorSharedVariable
    _averages: Callable[[], list[np.ndarray]]

    def __init__(self, params, updates, name, host_mode=None, is_step=None):
        self.params = check_params(params)
        self.host_mode = host_mode
        self._host_fn = None
        if not self.params:
            raise ValueError(f"{type(self).__name__} needs at least one parameter")
        self.name = name
        self._backup = None
        if updates is not None:
            missing = [param_label(p, i) for i, p in enumerate(self.params) if p not in updates]
            if missing:
                raise ValueError(
                    f"{type(self).__name__}: updates has no entry for {', '.join(missing)}; "
                    "pass the optimizer's update dictionary for these params"
                )
        # The value each step adds: the updated parameter when the optimizer's
        # updates are given (the average then includes this step's result, as
        # Paddle's averaging op that runs after the optimizer op), else the
        # parameter as it is when the function is called.
        self._values = [updates[p] if updates is not None else p for p in self.params]
        self._is_step = None
        if host_mode is None:
            self._is_step = step_signal(updates, self.params, is_step, type(self).__name__)
        else:
            if updates is not None or is_step is not None:
                raise ValueError(
                    f"{type(self).__name__}: with host_mode the average is advanced by "
                    "step() after each optimizer step; do not pass updates or is_step"
                )
            # The buffers are updated by a function of their own, compiled for
            # the CPU, that takes the parameters' values as inputs.
            self._values = [p.type(name=f"{param_label(p, i)}.value")
                            for i, p in enumerate(self.params)]

    def _finish(self, updates):
        """Gate the updates, or compile them into the host function."""
        if self.host_mode is None:
            return self._gate(updates)
        import pytensor

        self._host_fn = pytensor.function(self._values, [], updates=updates,
                                          mode=self.host_mode)
        return OrderedDict()

    def step(self) -> None:
        """Advance the average by one optimizer step (only with `host_mode`).

        Copies the parameters' current values to the host and updates the
        buffers there: one device-to-host copy of the parameters per step, in
        exchange for keeping the buffers out of the accelerator's memory.

        Raises
        ------
        RuntimeError
            Without `host_mode` (merge ``.updates`` instead).
        """
        if self._host_fn is None:
            raise RuntimeError(
                f"{self.name}: step() is for host_mode; otherwise merge .updates into "
                "the function that takes the optimizer step"
            )
        self._host_fn(*[_host(p.get_value(borrow=True)) for p in self.params])

    def _gate(self, updates):
        """Keep everything unchanged on calls that take no optimizer step."""
        return updates if self._is_step is None else guard_updates(updates, self._is_step)

    @property
    def steps(self) -> int:
        """Optimizer steps averaged so far (``apply()`` needs at least one)."""
        return int(_host(self.num_updates.get_value()))

    @property
    def applied(self) -> bool:
        """True between :meth:`apply` and :meth:`restore`."""
        return self._backup is not None

    def apply(self, need_restore: bool = True) -> AbstractContextManager[_SwappableAverage]:
        """Put the averaged values into the parameters.

        Use as a context manager (``with avg.apply(): evaluate()``) or call it
        and later :meth:`restore`.

        Parameters
        ----------
        need_restore : bool
            As a context manager: restore the trained values when the block
            ends (also when it raises). With False they stay averaged until
            :meth:`restore` is called.

        Returns
        -------
        context manager

        Raises
        ------
        RuntimeError
            If the averages are already applied (nested apply), or nothing has
            been averaged yet (no optimizer step so far).
        """
        if self._backup is not None:
            raise RuntimeError(
                f"{self.name}: averages are already applied; call restore() before "
                "applying again (apply() does not nest)"
            )
        if self.steps == 0:
            raise RuntimeError(
                f"{self.name}: nothing to apply: no optimizer step has been averaged yet "
                "(merge .updates into the function that takes the optimizer step and call it)"
            )
        averages = self._averages()
        self._backup = [np.array(_host(p.get_value(borrow=True)), copy=True)
                        for p in self.params]
        for p, avg in zip(self.params, averages):
            write_value(p, avg.astype(p.type.dtype, copy=False))
        return self._restoring(need_restore)

    @contextlib.contextmanager
    def _restoring(self, need_restore):
        try:
            yield self
        finally:
            if need_restore and self._backup is not None:
                self.restore()

    def restore(self) -> None:
        """Put the trained values back, bit for bit, from the backup copy.

        Raises
        ------
        RuntimeError
            If the averages are not applied.
        """
        if self._backup is None:
            raise RuntimeError(f"{self.name}: restore() without apply()")
        for p, value in zip(self.params, self._backup):
            write_value(p, value)
        self._backup = None

    def averages(self) -> list[np.ndarray]:
        """The averaged values as numpy arrays, without touching the params."""
        return [a.astype(p.type.dtype, copy=False) for p, a in zip(self.params, self._averages())]


class ModelAverage(_SwappableAverage):
    """Average the parameters over a sliding window of optimizer steps.

    The semantics are those of PaddlePaddle's ``average_accumulates`` kernel.
    Per parameter three sums ``sum_1, sum_2, sum_3`` and three shared
    counters. At each optimizer step, in this order:

    * ``num_updates += 1``, ``num_accumulates += 1``, ``sum_1 += param``
    * every `max_num_accumulates` updates: ``sum_2 += sum_1``, ``sum_1 = 0``
      (bounds the number of terms in one running sum)
    * when ``num_accumulates >= min_average_window`` and
      ``num_accumulates >= min(max_average_window,
      int(num_updates * average_window_rate))`` the window closes:
      ``sum_3 = sum_1 + sum_2``, ``sum_1 = sum_2 = 0``,
      ``old_num_accumulates = num_accumulates``, ``num_accumulates = 0``

    and the applied average is
    ``(sum_1 + sum_2 + sum_3) / (num_accumulates + old_num_accumulates)``:
    the current partial window together with the last closed one.

    Parameters
    ----------
    params : list of shared variables
        The parameters to average.
    average_window_rate : float
        The window grows with training: it closes once it holds this fraction
        of all updates so far (within the min/max bounds). In [0, 1].
    min_average_window : int
        A window never closes with fewer steps. Default 10000 (Paddle's).
    max_average_window : int
        A window always closes at this many steps (once at least
        `min_average_window`). Default 10000.
    max_num_accumulates : int
        Steps summed into ``sum_1`` before it moves into ``sum_2``; default
        16384 (Paddle's ``kMaxNumAccumulates``).
    updates : dict, optional
        The optimizer's update dictionary. When given, each step adds the
        *updated* parameter (``updates[param]``), like Paddle's averaging op,
        which runs after the optimizer op; without it the value before the
        step is added. A single-function dictionary (``average=N``), a copy
        of one, or the guarded dictionary of a rule given ``accu.grads`` also
        make the averaging advance on optimizer steps only (see `is_step`).
    is_step : symbolic boolean scalar or True, optional
        When a step happens, said explicitly: the average advances only on
        calls where it is true (``upd.is_step``, ``accu.is_step``); True: on
        every call. Default: read from `updates`, which records it on its
        values; a dictionary whose step signal cannot be known is refused
        (ValueError) rather than guessed.
    sum_dtype : str
        dtype of the sums, default float64: with float32 sums the average of a
        long window drifts by about 1e-4 relative (see Notes).
    host_mode : str, optional
        Keep the three sums in host memory when the model is compiled for an
        accelerator (``mode="JAX"`` on a GPU): give a CPU mode (``"NUMBA"`` or
        ``"CVM"``), leave ``.updates`` out of the training function (it is
        empty) and call :meth:`step` after each optimizer step. Costs one
        device-to-host copy of the parameters per step; saves three
        parameter-sized buffers on the device.
    name : str
        Prefix of the counters' names and of error messages.

    Attributes
    ----------
    updates : OrderedDict
        Merge it into the function that takes the optimizer step (the apply
        function of the two-function form, the single function otherwise), so
        that the averages count optimizer steps, not mini-batches.
    num_updates, num_accumulates, old_num_accumulates : shared int64 scalars
    sums : list of (sum_1, sum_2, sum_3) per parameter

    Raises
    ------
    ValueError
        If the rate is outside [0, 1], a window bound is negative,
        ``min_average_window > max_average_window``, or `max_num_accumulates`
        < 1.

    Notes
    -----
    How to choose the window: the average covers between one and two windows
    of steps (the partial current window and the last closed one). For an
    average over roughly the last epoch, set ``max_average_window`` to the
    number of optimizer steps per epoch and ``min_average_window`` to a
    fraction of it; the rate makes early windows short while the model still
    changes fast. Worked example: 50,000 examples, batches of 100 and
    accumulation over 5 batches give 100 optimizer steps per epoch; with
    ``average_window_rate=0.15, min_average_window=20, max_average_window=100``
    the window closes at step 20 (0.15 * 20 = 3 < 20), then every
    ``max(20, min(100, int(0.15 * step)))`` steps: every 20 steps until step
    ~133, growing to 100 steps (one epoch) from step ~667 on, so the applied
    average then spans the last one to two epochs.

    Sums are float64 by default: float32 sums of 16384 terms lose about
    ``16384 * 2**-24`` relative precision in the worst case, far above the
    1e-6 that an average used for evaluation should keep.

    The averaged weights of a model with batch normalisation need their
    batch statistics recomputed before evaluation.

    References
    ----------
    .. [1] Polyak, B. T. & Juditsky, A. B. (1992): Acceleration of stochastic
       approximation by averaging. SIAM J. Control Optim. 30(4), 838-855.
    .. [2] PaddlePaddle, ``fluid.optimizer.ModelAverage`` and the
       ``average_accumulates`` operator (2018).

    Examples
    --------
    >>> import numpy as np, pytensor
    >>> w = pytensor.shared(np.array([0.0]), name="w")
    >>> avg = ModelAverage([w], 0.5, min_average_window=2, max_average_window=4)
    >>> step = pytensor.function([], [], updates={w: w + 1, **avg.updates})
    >>> for _ in range(3):
    ...     step()             # adds w = 0, 1, 2; a window closes after 2 steps
    []
    []
    []
    >>> with avg.apply():
    ...     w.get_value()      # (0 + 1 + 2) / 3
    array([1.])
    >>> w.get_value()          # restored
    array([3.])
    """

    def __init__(
        self,
        params: Params,
        average_window_rate: float,
        min_average_window: int = 10000,
        max_average_window: int = 10000,
        *,
        max_num_accumulates: int = 16384,
        updates: UpdatesLike | None = None,
        is_step: Variable | bool | None = None,
        sum_dtype: str = "float64",
        host_mode: str | None = None,
        name: str = "model_average",
    ) -> None:
        super().__init__(params, updates, name, host_mode, is_step)
        rate = float(average_window_rate)
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"average_window_rate must be in [0, 1], got {average_window_rate}")
        min_average_window = check_int(min_average_window, "min_average_window", low=0)
        max_average_window = check_int(max_average_window, "max_average_window", low=0)
        max_num_accumulates = check_int(max_num_accumulates, "max_num_accumulates", low=1)
        if min_average_window > max_average_window:
            raise ValueError(
                f"min_average_window ({min_average_window}) must not exceed "
                f"max_average_window ({max_average_window})"
            )
        self.average_window_rate = rate
        self.min_average_window = int(min_average_window)
        self.max_average_window = int(max_average_window)
        self.max_num_accumulates = int(max_num_accumulates)

        self.num_updates = scalar_state(f"{name}.num_updates", "int64")
        self.num_accumulates = scalar_state(f"{name}.num_accumulates", "int64")
        self.old_num_accumulates = scalar_state(f"{name}.old_num_accumulates", "int64")
        self.sums = [tuple(state_like(p, f"{name}_sum_{k}", i, dtype=sum_dtype)
                           for k in (1, 2, 3)) for i, p in enumerate(self.params)]
        self.updates = self._finish(self._build())

    def _build(self):
        nu = self.num_updates + 1
        na = self.num_accumulates + 1
        move = pt.eq(pt.mod(nu, self.max_num_accumulates), 0)
        # int64 * float in the kernel: the product is a float32, truncated.
        product = pt.cast(pt.cast(nu, "float32") * np.float32(self.average_window_rate), "int64")
        limit = pt.minimum(np.int64(self.max_average_window), product)
        close = pt.and_(pt.ge(na, self.min_average_window), pt.ge(na, limit))

        updates = OrderedDict()
        for value, (s1, s2, s3) in zip(self._values, self.sums):
            value = pt.cast(value, s1.type.dtype)
            s1_new = s1 + value
            s2_new = pt.switch(move, s2 + s1_new, s2)
            s1_new = pt.switch(move, pt.zeros_like(s1_new), s1_new)
            updates[s3] = pt.switch(close, s1_new + s2_new, s3)
            updates[s1] = pt.switch(close, pt.zeros_like(s1_new), s1_new)
            updates[s2] = pt.switch(close, pt.zeros_like(s2_new), s2_new)
        updates[self.old_num_accumulates] = pt.switch(close, na, self.old_num_accumulates)
        updates[self.num_accumulates] = pt.switch(close, np.int64(0), na)
        updates[self.num_updates] = nu
        return updates

    def _averages(self):
        count = int(_host(self.num_accumulates.get_value())) + int(
            _host(self.old_num_accumulates.get_value()))
        if count == 0:
            raise RuntimeError(
                f"{self.name}: nothing to apply: no optimizer step has been averaged yet "
                "(merge .updates into the function that takes the optimizer step and call it)"
            )
        return [sum(_host(s.get_value(borrow=True)) for s in sums) / count for sums in self.sums]


class ExponentialMovingAverage(_SwappableAverage):
    """Exponential moving average of the parameters over optimizer steps.

    * ``t := t + 1``
    * ``d = min(decay, (1 + t) / (10 + t))`` when `warmup`, else ``decay``
    * ``shadow := d * shadow + (1 - d) * param``

    The shadow starts at the parameters' values when the average is created.

    Parameters
    ----------
    params : list of shared variables
        The parameters to average.
    decay : float or symbolic scalar
        Weight of the old average, in [0, 1]. Default 0.999 (an average over
        roughly the last 1000 steps).
    warmup : bool
        Use ``min(decay, (1 + t) / (10 + t))`` so that the first steps are
        not dominated by the initial values (TensorFlow's ``num_updates``
        option). Default False.
    updates : dict, optional
        The optimizer's update dictionary: the average then takes the updated
        parameters, and a single-function dictionary gates it to stepping
        calls (see :class:`ModelAverage`).
    is_step : symbolic boolean scalar or True, optional
        When a step happens, said explicitly (see :class:`ModelAverage`).
    shadow_dtype : str, optional
        dtype of the shadow variables; default float32 at least, the param's
        otherwise.
    host_mode : str, optional
        Keep the shadows in host memory and advance them with :meth:`step`
        (see :class:`ModelAverage`).
    name : str
        Prefix of the counter's name.

    Attributes
    ----------
    updates : OrderedDict
        Merge it into the function that takes the optimizer step.
    shadows : list of shared variables (``W.ema``)
    num_updates : shared int64 scalar

    Examples
    --------
    >>> import numpy as np, pytensor
    >>> w = pytensor.shared(np.array([0.0]), name="w")
    >>> ema = ExponentialMovingAverage([w], decay=0.5)
    >>> step = pytensor.function([], [], updates={w: w + 1, **ema.updates})
    >>> step(); step()
    []
    []
    >>> with ema.apply():
    ...     w.get_value()   # 0.5 * (0.5 * 0 + 0.5 * 0) + 0.5 * 1
    array([0.5])
    """

    def __init__(
        self,
        params: Params,
        decay: Scalar = 0.999,
        *,
        warmup: bool = False,
        updates: UpdatesLike | None = None,
        is_step: Variable | bool | None = None,
        shadow_dtype: str | None = None,
        host_mode: str | None = None,
        name: str = "ema",
    ) -> None:
        super().__init__(params, updates, name, host_mode, is_step)
        self.num_updates = scalar_state(f"{name}.num_updates", "int64")
        self.shadows = []
        for i, p in enumerate(self.params):
            dtype = shadow_dtype or ("float64" if p.type.dtype == "float64" else "float32")
            shadow = state_like(p, name, i, dtype=dtype)
            write_value(shadow, _host(p.get_value(borrow=True)).astype(dtype))
            self.shadows.append(shadow)
        t = self.num_updates + 1
        updates_out = OrderedDict()
        for value, shadow in zip(self._values, self.shadows):
            dtype = shadow.type.dtype
            d = hyperparameter(decay, "decay", dtype, low=0, high=1)
            if warmup:
                tf = pt.cast(t, dtype)
                d = pt.minimum(d, (1 + tf) / (10 + tf))
            updates_out[shadow] = d * shadow + (1 - d) * pt.cast(value, dtype)
        updates_out[self.num_updates] = t
        self.updates = self._finish(updates_out)

    def _averages(self):
        return [_host(s.get_value(borrow=True)) for s in self.shadows]
