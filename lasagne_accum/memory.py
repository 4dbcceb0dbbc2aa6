"""What fits in device memory: the micro-batch B and the accumulation count N.

Training with an effective batch of N*B through gradient accumulation keeps
the parameters, the rule's state and the gradient buffers on the device for
the whole run, and one micro-batch of B examples with its activations for
the length of a step. :func:`memory_plan` finds the largest B that fits a
memory budget from the compiled steps themselves: both training functions
(accumulate, apply) are compiled with ``lasagne_accum.mode("JAX")`` and XLA's
own memory analysis (``compiled.memory_analysis()``: argument, output,
donated and temporary bytes) gives each call's peak for a given B, without
running anything. Out-of-memory retries, with a smaller batch each time, are
the fallback this replaces.

XLA plans for the device JAX compiles for (its default backend: a GPU when
JAX has one). On the CPU the plan agrees with the measured peak of the step
(``tests/test_memory.py``); a plan made on one platform is an estimate for
another, whose compiler fuses differently.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence, Union

import numpy as np

from ._checks import check_int, check_params

if TYPE_CHECKING:
    from ._typing import Params, UpdateRule

__all__ = ["memory_plan", "MemoryPlan", "StepMemory", "step_memory", "MB"]

#: Bytes in a megabyte, as :class:`MemoryPlan` prints budgets and peaks.
MB = 10 ** 6

#: What :func:`memory_plan` takes as the model: ``(inputs, loss)``, or a
#: callable building them for a batch size.
Model = Union[Sequence[Any], Callable[[int], Sequence[Any]]]


@dataclass(frozen=True)
class StepMemory:
    """Device bytes of one call of a compiled function, from XLA's memory analysis.

    Attributes
    ----------
    arguments : int
        Every input, shared variables included.
    outputs : int
        Every output, new values of updated shared variables included.
    aliased : int
        Outputs written into donated arguments (the in-place updates): not
        allocated again.
    temporaries : int
        Intermediate values (activations, gradients before they are added
        to their buffers...).
    shared : int
        The shared variables among the arguments (resident between calls).
    """

    arguments: int
    outputs: int
    aliased: int
    temporaries: int
    shared: int

    @property
    def peak(self) -> int:
        """Arguments + outputs - aliased + temporaries: the most the call holds at once."""
        return self.arguments + self.outputs - self.aliased + self.temporaries

    @property
    def transient(self) -> int:
        """What the call needs on top of the resident shared values."""
        return self.peak - self.shared


@dataclass(frozen=True)
class MemoryPlan:
    """The micro-batch and accumulation count for an effective batch within a budget.

    Attributes
    ----------
    batch_size : int
        B, examples per call of the accumulate function: the largest divisor
        of `effective_batch` whose step fits.
    accumulate : int
        N = effective_batch / B, calls per optimizer step.
    effective_batch, budget : int
        As given (the budget in bytes).
    peak : int
        Bytes at the busiest moment of training with this B: the resident
        state plus the larger of the two steps' transient needs.
    state : int
        Bytes resident between calls: parameters, the rule's state, the
        gradient buffers and counters.
    accumulate_step, apply_step : StepMemory
        XLA's analysis of the two functions at this B.
    """

    batch_size: int
    accumulate: int
    effective_batch: int
    budget: int
    peak: int
    state: int
    accumulate_step: StepMemory
    apply_step: StepMemory

    def __str__(self) -> str:
        return (f"effective batch {self.effective_batch} on a budget of "
                f"{self.budget / MB:g} MB: B={self.batch_size}, N={self.accumulate} "
                f"(peak {self.peak / MB:.1f} MB, of which {self.state / MB:.1f} MB state)")


def _shapes(fn, values: Mapping[Any, Any]) -> tuple[list[tuple[tuple[int, ...], str]], int]:
    """``(shape, dtype)`` of each input of `fn`, and the bytes of its shared ones."""
    from pytensor.compile.sharedvalue import SharedVariable

    from ._pytensor.memory import inputs_of

    shapes, shared = [], 0
    for var in inputs_of(fn):
        if isinstance(var, SharedVariable):
            value = var.get_value(borrow=True)
            shape, dtype = tuple(np.shape(value)), str(var.type.dtype)
            shared += int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        elif var in values:
            shape, dtype = values[var]
        else:
            raise ValueError(f"step_memory(): no shape given for the input {var}")
        shapes.append((shape, dtype))
    return shapes, shared


def step_memory(fn: Any, *inputs: Any) -> StepMemory:
    """XLA's memory analysis of one call of `fn` with inputs like `inputs`.

    Parameters
    ----------
    fn : pytensor compiled function
        Compiled with ``mode=lasagne_accum.mode("JAX")``.
    *inputs : arrays, or (shape, dtype) pairs
        One per explicit input of `fn`, as you would call it; only their
        shapes and dtypes are used (nothing runs).

    Returns
    -------
    StepMemory

    Raises
    ------
    TypeError
        If `fn` was not compiled with ``lasagne_accum.mode("JAX")``.
    ValueError
        If the number of `inputs` is not the number of `fn`'s inputs.

    Examples
    --------
    >>> import numpy as np, pytensor, pytensor.tensor as pt
    >>> import lasagne_accum as la
    >>> w = pytensor.shared(np.zeros((100, 10)), name="w")
    >>> x = pt.matrix("x")
    >>> f = pytensor.function([x], [], updates=la.sgd(((x @ w) ** 2).mean(), [w], 0.1),
    ...                       mode=la.mode("JAX"))
    >>> use = step_memory(f, ((32, 100), "float64"))
    >>> use.shared, use.aliased      # w, 8000 bytes, updated in place
    (8000, 8000)
    """
    explicit = [spec.variable for spec in fn.maker.inputs if not spec.shared]
    if len(inputs) != len(explicit):
        raise ValueError(f"step_memory(): the function takes {len(explicit)} input(s), "
                         f"got {len(inputs)}")
    values = {}
    for var, value in zip(explicit, inputs):
        if isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], str):
            shape, dtype = tuple(value[0]), value[1]
        else:
            shape, dtype = tuple(np.shape(value)), str(np.asarray(value).dtype)
        values[var] = (shape, dtype)
    from ._pytensor.memory import analyse

    shapes, shared = _shapes(fn, values)
    stats = analyse(fn, shapes)
    return StepMemory(shared=shared, **stats)


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, int(n ** 0.5) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def memory_plan(
    model: Model,
    params: Params,
    effective_batch: int,
    budget: int,
    *,
    example: Sequence[Any],
    update_rule: UpdateRule | None = None,
    rule_kwargs: Mapping[str, Any] | None = None,
) -> MemoryPlan:
    """The largest micro-batch B that trains an effective batch within a memory budget.

    Compiles the two functions of :func:`~lasagne_accum.compile_accumulation`
    (accumulate a micro-batch's gradient; apply the rule and reset) with
    ``lasagne_accum.mode("JAX")`` and asks XLA what each call needs for a
    given B (:func:`step_memory`). B runs over the divisors of
    `effective_batch` (so that every micro-batch has B examples), in a
    bisection: a few compilations, nothing is run.

    Parameters
    ----------
    model : (inputs, loss) or callable
        The symbolic inputs of a micro-batch (batch on axis 0) and the loss
        (a mean over the batch) built from them and `params`; or a callable
        ``model(batch_size)`` returning ``(inputs, loss)``, for graphs whose
        shapes depend on the batch size.
    params : list of shared variables
        The parameters to train.
    effective_batch : int
        N*B, the batch of one optimizer step.
    budget : int
        Device memory for training, in bytes (``400 * lasagne_accum.memory.MB``).
    example : sequence of arrays
        One array per input holding at least one example (axis 0 is the
        batch): the shapes and dtypes of an example.
    update_rule : callable, optional
        The rule you train with (its state, Adam's two moments for example,
        stays on the device): default :func:`lasagne_accum.sgd`, which has
        none.
    rule_kwargs : dict, optional
        Its hyperparameters (default ``learning_rate=0.01``).

    Returns
    -------
    MemoryPlan
        ``str(plan)`` reads "effective batch 4096 on a budget of 400 MB:
        B=512, N=8 (...)".

    Raises
    ------
    ValueError
        If even one example per micro-batch does not fit: the message gives
        the smallest budget that does; on a bad `effective_batch`, `budget`
        or `example`.
    TypeError
        If `params` are not shared variables, or `model` is neither a pair
        nor a callable.

    Notes
    -----
    For a micro-batch of B examples, a call holds what is resident between
    calls (every shared variable of both functions: ``state``) and, for the
    length of the call, what XLA reports on top of its own shared arguments:
    the batch, the outputs that are not written in place, the temporaries.
    The plan's peak is ``state + max(accumulate(B), apply)`` of those.

    Examples
    --------
    >>> import numpy as np, pytensor, pytensor.tensor as pt
    >>> import lasagne_accum as la
    >>> from lasagne_accum.memory import memory_plan, MB
    >>> W = pytensor.shared(np.zeros((64, 256), "float32"), name="W")
    >>> x, y = pt.matrix("x", dtype="float32"), pt.matrix("y", dtype="float32")
    >>> loss = ((pt.tanh(x @ W) - y) ** 2).mean()
    >>> example = (np.zeros((1, 64), "float32"), np.zeros((1, 256), "float32"))
    >>> plan = memory_plan(([x, y], loss), [W], 4096, 3 * MB, example=example,
    ...                    update_rule=la.adam)
    >>> plan.batch_size * plan.accumulate, plan.peak <= 3 * MB
    (4096, True)
    >>> memory_plan(([x, y], loss), [W], 4096, 100_000, example=example)
    Traceback (most recent call last):
    ...
    ValueError: memory_plan(): a budget of 0.1 MB does not fit one example per micro-batch: ...
    """
    import pytensor

    from .accumulate import accumulate_gradients
    from .merge import merge_updates
    from .modes import mode as la_mode
    from .rules.lasagne import sgd

    effective_batch = check_int(effective_batch, "effective_batch")
    if isinstance(budget, bool) or not isinstance(budget, (int, float, np.integer,
                                                            np.floating)) or not budget > 0:
        raise ValueError(f"memory_plan(): budget must be a positive number of bytes, "
                         f"got {budget!r}")
    params = check_params(params)
    if callable(model):
        build: Callable[[int], Sequence[Any]] = model
    elif isinstance(model, (list, tuple)) and len(model) == 2:
        fixed = tuple(model)

        def build(batch_size: int) -> Sequence[Any]:
            return fixed
    else:
        raise TypeError("memory_plan(): model must be (inputs, loss) or a callable "
                        f"model(batch_size) -> (inputs, loss), got {type(model).__name__}")
    example = [np.asarray(e) for e in example]
    if any(e.ndim == 0 or len(e) == 0 for e in example):
        raise ValueError("memory_plan(): every example array needs a batch axis (axis 0) "
                         "with at least one example")
    rule = update_rule or sgd
    hyper = dict(rule_kwargs if rule_kwargs is not None else {"learning_rate": 0.01})
    jax_mode = la_mode("JAX")
    compiled: dict[int, Any] = {}
    steps: dict[int, StepMemory] = {}

    def functions(batch_size: int):
        key = 0 if not callable(model) else batch_size
        if key not in compiled:
            inputs, loss = build(batch_size)
            inputs = list(inputs)
            if len(inputs) != len(example):
                raise ValueError(f"memory_plan(): {len(inputs)} input(s) but "
                                 f"{len(example)} example array(s)")
            acc = accumulate_gradients(loss, params, name="plan")
            apply = merge_updates(rule(acc.grads, acc.params, **hyper), acc.reset)
            accumulate_fn = pytensor.function(inputs, [], updates=acc.accumulate,
                                              mode=jax_mode)
            apply_fn = pytensor.function([], [], updates=apply, mode=jax_mode)
            compiled[key] = (accumulate_fn, apply_fn)
        return compiled[key]

    def accumulate_step(batch_size: int) -> StepMemory:
        if batch_size not in steps:
            accumulate_fn, _ = functions(batch_size)
            batch = [((batch_size,) + e.shape[1:], str(e.dtype)) for e in example]
            steps[batch_size] = step_memory(accumulate_fn, *batch)
        return steps[batch_size]

    accumulate_fn, apply_fn = functions(1)
    apply_step = step_memory(apply_fn)
    state = _state_bytes(accumulate_fn, apply_fn)

    def peak(batch_size: int) -> int:
        return state + max(accumulate_step(batch_size).transient, apply_step.transient)

    candidates = _divisors(effective_batch)
    smallest = peak(1)
    if smallest > budget:
        raise ValueError(
            f"memory_plan(): a budget of {budget / MB:g} MB does not fit one example per "
            f"micro-batch: that takes {smallest / MB:.3f} MB ({smallest} bytes: "
            f"{state / MB:.3f} MB of parameters, rule state and buffers, and the step); "
            f"the smallest budget that fits is {smallest} bytes")
    low, high = 0, len(candidates) - 1   # candidates[low] fits; find the largest that does
    while low < high:
        middle = (low + high + 1) // 2
        if peak(candidates[middle]) <= budget:
            low = middle
        else:
            high = middle - 1
    batch_size = candidates[low]
    return MemoryPlan(batch_size=batch_size, accumulate=effective_batch // batch_size,
                      effective_batch=effective_batch, budget=int(budget),
                      peak=peak(batch_size), state=state,
                      accumulate_step=accumulate_step(batch_size), apply_step=apply_step)


def _state_bytes(*functions: Any) -> int:
    """Bytes of every shared variable the functions read or update (each counted once)."""
    from pytensor.compile.sharedvalue import SharedVariable

    from ._pytensor.memory import inputs_of

    seen: dict[int, int] = {}
    for fn in functions:
        for var in inputs_of(fn):
            if isinstance(var, SharedVariable):
                value = var.get_value(borrow=True)
                seen[id(var.container)] = (int(np.prod(np.shape(value), dtype=np.int64))
                                           * np.dtype(var.type.dtype).itemsize)
    return sum(seen.values())

