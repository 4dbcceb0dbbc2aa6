"""Compile the two training functions and drive them: a thin, visible loop.

:func:`compile_accumulation` builds what the two-function recipe of
:func:`lasagne_accum.accumulate_gradients` writes by hand, and returns an
:class:`AccumulationTrainer` whose :meth:`~AccumulationTrainer.step` calls the
accumulate function every batch and the apply function every N-th batch.
:func:`run_epoch` loops over batches with a progress bar and flushes the
partial window at the end of the epoch.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Sequence

import numpy as np
import pytensor

from ._checks import check_int, check_rule_updates
from .accumulate import accumulate_gradients
from .batch_norm import ExactBatchNorm, PooledBatchNorm, batch_norm_layers, batch_norm_updates
from .merge import merge_updates
from .modes import default_modes, float_dtype, mode as la_mode
from .noise import NoiseEstimate, gradient_noise
from .progress import Progress

if TYPE_CHECKING:
    from pytensor.graph.basic import Variable

    from .accumulate import Accumulation
    from .model_average import ExponentialMovingAverage, ModelAverage
    from ._typing import Params, PathLike, Scalar, UpdateRule, UpdatesLike

__all__ = ["compile_accumulation", "AccumulationTrainer", "ExactTrainer", "run_epoch"]


def _copy_of(value: Any) -> Any:
    """A copy of a shared variable's value that a later call cannot change."""
    import copy

    from ._graph import as_host_array

    if isinstance(value, np.ndarray):
        return value.copy()
    if isinstance(value, (np.random.Generator, np.random.RandomState)):
        return copy.deepcopy(value)
    return as_host_array(value)     # a JAX or torch array: copied to the host


def warm_up_calls(touched: Iterable[Any], *calls: Callable[[], Any]) -> float:
    """Make `calls` once, then put back the value of every shared variable in `touched`.

    JIT backends (Numba, JAX, PyTorch) compile a function on its first call:
    warming up moves that time to where compiling is counted. Returns the
    seconds the calls took.
    """
    import time

    from ._graph import write_value

    touched = list({id(v): v for v in touched}.values())
    saved = [(v, _copy_of(v.get_value(borrow=True))) for v in touched]
    start = time.perf_counter()
    try:
        for call in calls:
            call()
    finally:
        for v, value in saved:
            if isinstance(value, np.ndarray):
                write_value(v, value)     # a device tensor keeps its storage
            else:
                v.set_value(value)        # a random generator
    return time.perf_counter() - start


class AccumulationTrainer:
    """Two compiled functions and the loop logic between them.

    Attributes
    ----------
    accumulate_fn : pytensor compiled function
        Called with one batch; returns the loss (and any extra outputs) and
        adds the batch's gradients to the buffers.
    apply_fn : pytensor compiled function
        No inputs; applies the rule to the accumulated gradients and resets
        the buffers. A no-op when nothing is accumulated.
    accumulation : Accumulation
        The result of :func:`accumulate_gradients` (``.count``, ``.grads``,
        ``.skipped``...).
    every : int or callable
        Batches per optimizer step, or the callable of the examples seen that
        gives each window's number of batches (see :func:`compile_accumulation`).
    window : int
        The number of batches of the window now filling, or of the last one
        between windows (``every``, or what the callable returned at the
        window's start; 0 before the first). Saved by :meth:`save`.
    steps : int
        Optimizer steps taken through :meth:`step` and :meth:`flush`.
    examples : int or float
        Examples applied so far: the total weight of every applied window (the
        number of batches when no `weight` was given). Saved by :meth:`save`.
    gradient_noise : NoiseEstimate or None
        With ``noise_scale``: the last window's estimates (``.grad_sq``,
        ``.trace``, ``.b_simple``, floats; NaN for a window of one batch).
    noise_scale : float or None
        With ``noise_scale``: B_simple from running averages of ``|G|^2`` and
        ``tr(Sigma)``, kept separately (the ratio of the averages, never the
        average of the windows' ratios); None before the first window of two
        or more batches. Saved by :meth:`save`.
    apply_updates : OrderedDict
        The apply function's update dictionary (rule state included), for
        :func:`lasagne_accum.save_state`.
    accumulate_updates : OrderedDict
        The accumulate function's update dictionary (the buffers, and the
        batch-norm layers' running averages or pooled sums).
    model_average, ema : ModelAverage, ExponentialMovingAverage or None
        The averages built by ``compile_accumulation(model_average=...,
        ema=...)``: ``with trainer.model_average.apply(): evaluate()``.
    compile_seconds : float
        Seconds :func:`compile_accumulation` took, the warm-up calls included
        when it was given an `example` batch.
    """

    def __init__(
        self,
        accumulate_fn: Callable[..., Any],
        apply_fn: Callable[[], Any],
        accumulation: Accumulation,
        every: int | Callable[[Any], int],
        apply_updates: UpdatesLike | None = None,
        *,
        model_average: ModelAverage | None = None,
        ema: ExponentialMovingAverage | None = None,
        noise_decay: float | None = None,
        outputs_total: bool = False,
    ) -> None:
        self.accumulate_fn = accumulate_fn
        self.apply_updates = apply_updates if apply_updates is not None else {}
        # an Accumulation, or its accumulate dictionary (which is the updates itself)
        updates: Any = getattr(accumulation, "accumulate", accumulation)
        self.accumulate_updates: UpdatesLike = OrderedDict(updates)
        self.apply_fn = apply_fn
        self.accumulation = accumulation
        self.every = every
        self.window = every if isinstance(every, int) else 0
        self.steps = 0
        self.examples: int | float = 0
        self.gradient_noise: NoiseEstimate | None = None
        self._noise_decay = noise_decay
        # compile_accumulation's apply function returns the window's total weight (then the
        # noise estimates); another apply function's outputs are its own
        self._outputs_total = outputs_total
        self._noise_avg: tuple[float, float] | None = None  # running |G|^2, tr(Sigma)
        self.model_average = model_average
        self.ema = ema
        self.compile_seconds = 0.0
        self._pending: int | None = None  # batches in the window; read from the counter when None

    @property
    def pending(self) -> int:
        """Batches accumulated and not yet applied (read from the counter)."""
        return int(np.asarray(self.accumulation.count.get_value()))

    @property
    def noise_scale(self) -> float | None:
        if self._noise_avg is None:
            return None
        grad_sq, trace = self._noise_avg
        return trace / grad_sq

    def window_size(self) -> int:
        """The number of batches of the window now filling (``every``'s value at its start).

        Raises
        ------
        ValueError, TypeError
            If a callable `every` returns something other than a positive
            integer (nothing has been accumulated for the window then).
        """
        if self._pending is None:
            self._pending = self.pending
        if not callable(self.every):
            return self.every
        if self._pending == 0 or self.window == 0:  # a window starts (or resumes unknown)
            k = self.every(self.examples)
            if isinstance(k, (bool, np.bool_)) or not isinstance(k, (int, np.integer)) or \
                    k < 1:
                raise ValueError(f"every({self.examples!r}) returned {k!r}: a window's number "
                                 "of batches must be a positive integer")
            self.window = int(k)
        return self.window

    def step(self, *batch: Any) -> Any:
        """Accumulate one batch; apply when the window's batches are in.

        Returns
        -------
        The accumulate function's outputs for this batch (the loss).
        """
        window = self.window_size()
        out = self.accumulate_fn(*batch)
        if self.accumulation.skipped is None and self._pending is not None:
            self._pending += 1
        else:  # a skipped batch does not count: read the real counter
            self._pending = self.pending
        if self._pending >= window:
            self._apply()
        return out

    def flush(self) -> bool:
        """Apply a partial window (for the end of an epoch).

        Returns
        -------
        bool
            True if a step was taken, False if nothing was accumulated.
        """
        if self.pending == 0:
            self._pending = 0
            return False
        self._apply()
        return True

    def save(self, path: PathLike, *more: Any, metadata: Mapping[str, Any] | None = None
             ) -> list[str]:
        """Checkpoint everything the two functions update (and `more`), and :attr:`steps`.

        See :func:`lasagne_accum.save_state`: `metadata` is your loop state
        (epoch, position, the data RNG's state), returned by :meth:`load`. A
        mid-window checkpoint resumes the window where it stopped; the model
        average and EMA are saved with the rest.

        Raises
        ------
        RuntimeError
            If an average is applied (the parameters hold the averages): call
            its ``restore()`` first, or the averages would be saved as the
            trained values.
        """
        from .checkpoint import write_state

        for average in (self.model_average, self.ema):
            if average is not None and average.applied:
                raise RuntimeError(f"save(): {average.name} is applied, so the parameters "
                                   "hold its averages; restore() it before saving")
        trainer: dict[str, Any] = {"steps": self.steps, "examples": self.examples,
                                   "window": self.window}
        if self._noise_avg is not None:
            trainer["noise_average"] = list(self._noise_avg)
        return write_state(path, [self, *more], metadata, library={"trainer": trainer})

    def load(self, path: PathLike, *more: Any) -> dict[str, Any]:
        """Load a checkpoint written by :meth:`save`, resume its window and :attr:`steps`.

        Returns
        -------
        dict
            The `metadata` given to :meth:`save` (``{}`` if none).
        """
        from .checkpoint import read_state

        metadata, library, _ = read_state(path, [self, *more])
        self._pending = None
        saved = library.get("trainer", {})
        if saved.get("steps") is not None:
            self.steps = int(saved["steps"])
        if saved.get("examples") is not None:
            examples = saved["examples"]
            self.examples = int(examples) if float(examples).is_integer() else float(examples)
        average = saved.get("noise_average")
        self._noise_avg = (float(average[0]), float(average[1])) if average else None
        if callable(self.every):
            self.window = int(saved.get("window") or 0)   # 0: read again from every()
        return metadata

    def warm_up(self, *batch: Any) -> float:
        """Call both functions once on `batch` and put every value back; return the seconds.

        JIT backends (Numba, JAX, PyTorch) compile a function on its first
        call: warming up moves that time to where you count compiling, and
        leaves the model, the rule's state and the window as they were.
        """
        from .checkpoint import collect_state

        # everything the two functions update: their update dictionaries, and the
        # shared variables with a default update (a random stream's generator)
        touched = list(collect_state(self).values())
        for fn in (self.accumulate_fn, self.apply_fn):
            maker = getattr(fn, "maker", None)
            touched += [i.variable for i in getattr(maker, "inputs", ())
                        if getattr(i, "update", None) is not None]
        return warm_up_calls(touched, lambda: self.accumulate_fn(*batch), self.apply_fn)

    def _apply(self):
        if not self._outputs_total:
            total = float(np.asarray(self.accumulation.total.get_value()))
        out = self.apply_fn()
        if self._outputs_total:
            total = float(np.asarray(out[0]))
            if len(out) > 1:
                self._note_noise(*(float(np.asarray(v)) for v in out[1:4]))
        self.examples += int(total) if total.is_integer() else total
        self.steps += 1
        self._pending = 0

    def _note_noise(self, grad_sq: float, trace: float, b_simple: float) -> None:
        """Keep the window's estimates, and fold them into the running averages."""
        self.gradient_noise = NoiseEstimate(grad_sq, trace, b_simple)
        if not (np.isfinite(grad_sq) and np.isfinite(trace)):
            return   # a window of one batch: no estimate
        if self._noise_avg is None:
            self._noise_avg = (grad_sq, trace)
            return
        d = self._noise_decay if self._noise_decay is not None else 0.0
        old_g, old_t = self._noise_avg
        self._noise_avg = (d * old_g + (1 - d) * grad_sq, d * old_t + (1 - d) * trace)


def compile_accumulation(
    inputs: Sequence[Variable],
    loss: Variable,
    params: Params,
    update_rule: UpdateRule,
    rule_kwargs: Mapping[str, Any] | None = None,
    every: int | Callable[[Any], int] = 1,
    *,
    weight: Scalar | None = None,
    average: bool = True,
    max_norm: Scalar | None = None,
    skip_nonfinite: bool = False,
    noise_scale: bool | Mapping[str, Any] = False,
    batch_norm: str = "ghost",
    running_stats: str | None = None,
    outputs: Sequence[Variable] | None = None,
    extra_accumulate_updates: UpdatesLike | Callable[[UpdatesLike], UpdatesLike] | None = None,
    extra_apply_updates: UpdatesLike | Callable[[UpdatesLike], UpdatesLike] | None = None,
    model_average: Mapping[str, Any] | None = None,
    ema: Mapping[str, Any] | None = None,
    mode: Any = None,
    apply_mode: Any = None,
    example: Sequence[Any] | None = None,
    name: str = "accumulate",
) -> AccumulationTrainer:
    """Compile the accumulate and apply functions of the two-function form.

    Parameters
    ----------
    inputs : list of symbolic variables
        Inputs of the per-batch function (the batch, and the weight's input if
        any).
    loss : symbolic scalar
        The loss to differentiate, a mean over the batch.
    params : list of shared variables
        The parameters to train.
    update_rule : callable
        Any rule: ``update_rule(grads, params, **rule_kwargs)`` returning an
        update dictionary (:func:`lasagne_accum.adam`, a partial, your own).
    rule_kwargs : dict, optional
        Hyperparameters for `update_rule`.
    every : int or callable
        Batches per optimizer step (N), or a callable of the examples applied
        so far (``trainer.examples``) returning the number of batches of the
        next window: a batch-size schedule, read at each window's start (K is
        a run-time value: nothing is compiled again). :class:`FollowNoiseScale`
        is one that follows the measured noise scale.
    weight : symbolic scalar, optional
        The batch's weight (its number of examples), for an exact mean over
        batches of different sizes; must be computable from `inputs`.
    average, max_norm, skip_nonfinite
        Passed to :func:`lasagne_accum.accumulate_gradients`.
    noise_scale : bool or dict
        True, or ``dict(population=N, decay=d)``: measure the gradient noise
        scale with each window (:func:`lasagne_accum.gradient_noise`; needs
        `weight`). ``trainer.gradient_noise`` holds the last window's
        estimates and ``trainer.noise_scale`` B_simple from running averages
        (``avg := d * avg + (1 - d) * window``, ``d`` 0.9 by default; the first
        window's estimate starts them) of ``|G|^2`` and ``tr(Sigma)``.
        `population`: the data set's size when batches are drawn from it
        without replacement (the finite-data correction).
    batch_norm : {"ghost", "exact"}
        How the :func:`lasagne_accum.batch_norm` layers of `loss` are
        normalised under accumulation: ``"ghost"`` (default), each micro-batch
        with its own statistics (a ghost batch: what a multi-device run computes
        per device); ``"exact"``, with the statistics of the whole window (what
        one device with the large batch, or SyncBatchNorm, computes): the
        trainer holds the window's micro-batches and, when the window is
        complete, runs ``2 L + 1`` passes over them for L batch-norm layers
        (:class:`lasagne_accum.batch_norm.ExactBatchNorm`; needs `weight`).
    running_stats : {"each", "pooled"}, optional
        How the batch-norm layers' running averages move: ``"each"`` (the
        default with ghost batches), once per micro-batch (a PyTorch loop over
        micro-batches); ``"pooled"`` (the only one with ``"exact"``), once per
        window with the window's pooled mean and unbiased variance (the
        running averages of one large batch of the same activations;
        :class:`lasagne_accum.batch_norm.PooledBatchNorm`).
    outputs : list of symbolic variables, optional
        Outputs of the per-batch function; default ``[loss]``.
    extra_accumulate_updates : dict or callable, optional
        More updates for the accumulate function, so that they run once per
        micro-batch and may use the batch's inputs: running statistics of your
        own layers, a random generator's next state (dropout: ``{rng:
        next_rng}``). A callable receives the accumulate dictionary (the
        buffers' updates) and returns the extra updates. Saved by
        :meth:`AccumulationTrainer.save` with the rest. Not with
        ``batch_norm="exact"``, which evaluates each micro-batch several times.
    extra_apply_updates : dict or callable, optional
        More updates for the apply function, so that they run once per
        optimizer step. A callable receives the rule's update dictionary and
        returns the extra updates. The apply function has no inputs: an update
        that needs the batch's belongs in `extra_accumulate_updates`.
    model_average, ema : dict, optional
        Keyword arguments of :class:`~lasagne_accum.ModelAverage` and
        :class:`~lasagne_accum.ExponentialMovingAverage` (``params``,
        ``updates`` and ``is_step`` aside): the average of the parameters'
        values after each optimizer step, kept by the apply function and
        reachable as ``trainer.model_average`` / ``trainer.ema``.
    mode, apply_mode : str or Mode, optional
        Base compilation modes of the two functions (by default
        :func:`~lasagne_accum.default_modes`), compiled through
        :func:`lasagne_accum.mode`. Give `mode` alone to use it for both.
    example : tuple, optional
        One batch of inputs: both functions are called on it once and every
        value put back (:meth:`AccumulationTrainer.warm_up`), so that JIT
        backends, which compile on the first call, have compiled when this
        returns; ``trainer.compile_seconds`` counts it.
    name : str
        Prefix of the accumulation's counters and (when not the default)
        buffers, as in :func:`lasagne_accum.accumulate_gradients`.

    Returns
    -------
    AccumulationTrainer

    Raises
    ------
    TypeError, ValueError
        On bad `every`, `update_rule` or inputs (see
        :func:`accumulate_gradients`), `model_average` or `ema` that are not
        dicts of their class's keywords, an extra update of a variable the
        rule or the accumulation updates too, or an extra apply update that
        needs the batch's inputs.

    Examples
    --------
    >>> import numpy as np, pytensor, pytensor.tensor as pt
    >>> from lasagne_accum import sgd
    >>> w = pytensor.shared(0.0, name="w")
    >>> x = pt.vector("x")
    >>> trainer = compile_accumulation([x], ((w - x) ** 2).mean(), [w], sgd,
    ...                                dict(learning_rate=0.5), every=2,
    ...                                weight=x.shape[0])
    >>> _ = trainer.step([1.0, 2.0]); trainer.steps, float(w.get_value())
    (0, 0.0)
    >>> _ = trainer.step([6.0]); trainer.steps, float(w.get_value())
    (1, 3.0)
    >>> trainer.flush()      # nothing pending: no step
    False
    """
    import time

    from .model_average import ExponentialMovingAverage, ModelAverage

    start = time.perf_counter()
    if not callable(every):
        every = check_int(every, "every")
    if not callable(update_rule):
        raise TypeError(f"update_rule must be callable, got {type(update_rule).__name__}")
    for label, kwargs in (("model_average", model_average), ("ema", ema)):
        if kwargs is not None and not isinstance(kwargs, Mapping):
            raise TypeError(f"{label} must be a dict of keyword arguments, got "
                            f"{type(kwargs).__name__}")
        taken = {"params", "updates", "is_step"} & set(kwargs or {})
        if taken:
            raise TypeError(f"{label}: {', '.join(sorted(taken))} are set by "
                            "compile_accumulation (the parameters, the rule's updates and "
                            "the optimizer step); leave them out")
        if "host_mode" in (kwargs or {}):
            raise TypeError(f"{label}: host_mode keeps the average out of the apply step; "
                            "build the average yourself and call its step() after each "
                            "optimizer step")
    noise_options = _noise_options(noise_scale)
    if batch_norm not in ("ghost", "exact"):
        raise ValueError(f"batch_norm must be 'ghost' or 'exact', got {batch_norm!r}")
    if running_stats is None:
        running_stats = "pooled" if batch_norm == "exact" else "each"
    if running_stats not in ("each", "pooled"):
        raise ValueError(f"running_stats must be 'each' or 'pooled', got {running_stats!r}")
    bn_layers = batch_norm_layers(loss)
    exact = None
    if batch_norm == "exact" and bn_layers:
        if running_stats != "pooled":
            raise ValueError("batch_norm='exact' moves the running statistics once per window, "
                             "with the window's statistics: running_stats must be 'pooled'")
        if weight is None:
            raise ValueError("batch_norm='exact' needs weight= (the number of examples in each "
                             "micro-batch): the window's statistics weigh each by it")
        if noise_scale:
            raise ValueError("noise_scale cannot be measured with batch_norm='exact' (its "
                             "micro-batch gradients are not samples of the large batch's); "
                             "use batch_norm='ghost'")
        exact = ExactBatchNorm(loss, weight)
    acc = accumulate_gradients(loss if exact is None else exact.surrogate(), params,
                               average=average, weight=weight,
                               max_norm=max_norm, skip_nonfinite=skip_nonfinite,
                               noise_scale=noise_options is not None, name=name)
    rule = check_rule_updates(update_rule, acc.grads, acc.params, dict(rule_kwargs or {}))
    if callable(extra_apply_updates):
        # the extras see the rule's new values (an average of the stepped parameters)
        extra_apply_updates = extra_apply_updates(OrderedDict(rule))
    if extra_apply_updates:
        _check_extra("extra_apply_updates", extra_apply_updates, rule, "the rule")
        _check_no_batch_inputs(extra_apply_updates)
    stepped = acc.guard(merge_updates(rule, extra_apply_updates))
    averages: dict[str, Any] = {}
    if model_average is not None:
        averages["model_average"] = ModelAverage(acc.params, updates=stepped,
                                                 is_step=acc.is_step, **model_average)
    if ema is not None:
        averages["ema"] = ExponentialMovingAverage(acc.params, updates=stepped,
                                                   is_step=acc.is_step, **ema)
    accumulate_updates, running_apply = OrderedDict(acc.accumulate), OrderedDict()
    if exact is not None:
        running_apply = exact.running_updates(acc.is_step)
    elif bn_layers and running_stats == "each":
        accumulate_updates = merge_updates(accumulate_updates, batch_norm_updates(loss))
    elif bn_layers:
        pooled = PooledBatchNorm(loss, acc.is_step, name=f"{name}_pooled")
        accumulate_updates = merge_updates(accumulate_updates, pooled.accumulate)
        running_apply = pooled.apply
    if callable(extra_accumulate_updates):
        extra_accumulate_updates = extra_accumulate_updates(OrderedDict(accumulate_updates))
    if extra_accumulate_updates:
        if exact is not None:
            raise ValueError("extra_accumulate_updates cannot be used with batch_norm='exact': "
                             "it evaluates each micro-batch several times per window, so "
                             "per-batch updates (a random generator's) would not run once per "
                             "micro-batch; use batch_norm='ghost'")
        _check_extra("extra_accumulate_updates", extra_accumulate_updates, accumulate_updates,
                     "the accumulation (its buffers, or the batch-norm running averages)")
        accumulate_updates = merge_updates(accumulate_updates, extra_accumulate_updates)
    apply = merge_updates(stepped, *(a.updates for a in averages.values()), running_apply,
                          acc.reset)

    default_acc, default_apply = (None, None) if mode is not None else \
        default_modes(float_dtype(acc.params))
    fn_outputs: Any = loss if outputs is None else list(outputs)
    if exact is not None:   # the window's statistics in the outputs too
        fn_outputs = exact.loss if outputs is None else exact.with_window_statistics(outputs)
    if mode is not None and apply_mode is None:
        apply_mode = mode
    accumulate_fn = pytensor.function(
        list(inputs), fn_outputs, updates=accumulate_updates,
        mode=la_mode(mode or default_acc),
    )
    # the window's total weight (trainer.examples) and the noise estimates, read before the
    # reset empties the window
    apply_outputs: list[Any] = [acc.total]
    if noise_options is not None:
        apply_outputs += gradient_noise(acc, noise_options["population"]).outputs
    apply_fn = pytensor.function([], apply_outputs, updates=apply,
                                 mode=la_mode(apply_mode or default_apply))
    if exact is not None:
        trainer: AccumulationTrainer = ExactTrainer(
            accumulate_fn, apply_fn, acc, every, apply_updates=apply, outputs_total=True,
            passes=_exact_passes(exact, list(inputs), weight, mode or default_acc),
            **averages)
    else:
        trainer = AccumulationTrainer(accumulate_fn, apply_fn, acc, every, apply_updates=apply,
                                      noise_decay=(noise_options or {}).get("decay"),
                                      outputs_total=True, **averages)
    trainer.accumulate_updates = accumulate_updates
    if hasattr(every, "bind"):
        every.bind(trainer)
    if example is not None:
        trainer.warm_up(*example)
    trainer.compile_seconds = time.perf_counter() - start
    return trainer


class ExactTrainer(AccumulationTrainer):
    """The trainer of ``compile_accumulation(batch_norm="exact")``.

    :meth:`step` holds the micro-batch (its inputs) and returns None until the window
    is complete; then it runs the passes of
    :class:`~lasagne_accum.batch_norm.ExactBatchNorm` over the held micro-batches,
    applies the rule, and returns the window's mean loss (the micro-batches' losses
    under the window's statistics, weighted by their sizes). :meth:`flush` does the
    same for a partial window. A checkpoint holds no micro-batches: :meth:`save`
    refuses to save in the middle of a window.
    """

    def __init__(self, *args: Any, passes: dict[str, Any], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._passes = passes
        self._held: list[tuple[Any, ...]] = []

    @property
    def pending(self) -> int:
        """Micro-batches held for the window now filling."""
        return len(getattr(self, "_held", ()))

    def step(self, *batch: Any) -> Any:
        self._pending = len(self._held)
        window = self.window_size()
        self._held.append(tuple(np.array(b, copy=True) for b in batch))
        if len(self._held) >= window:
            return self._run_window()
        return None

    def flush(self) -> bool:
        if not self._held:
            return False
        self._run_window()
        return True

    def save(self, path: PathLike, *more: Any, metadata: Mapping[str, Any] | None = None
             ) -> list[str]:
        if self._held:
            raise RuntimeError(
                f"save(): batch_norm='exact' holds {len(self._held)} micro-batch(es) of an "
                "unfinished window, which a checkpoint does not keep; save when a window is "
                "complete (after the step that applied it, or after flush())")
        return super().save(path, *more, metadata=metadata)

    def _run_window(self) -> float:
        p = self._passes
        held, self._held = self._held, []
        weights = [float(np.asarray(p["weight"](*b))) for b in held]
        p["window"].set_value(np.asarray(sum(weights), p["window"].type.dtype))
        for gather, finish in p["statistics"]:
            for b in held:
                gather(*b)
            finish()
        for gather, finish in p["adjoints"]:
            for b in held:
                gather(*b)
            finish()
        losses = []
        for b in held:
            out = self.accumulate_fn(*b)
            losses.append(float(np.asarray(out[0] if isinstance(out, (list, tuple)) else out)))
        self._pending = len(held)
        self._apply()
        return float(np.dot(weights, losses) / sum(weights))


def _exact_passes(exact: ExactBatchNorm, inputs: list[Any], weight: Any, base: Any
                  ) -> dict[str, Any]:
    """Compile the statistics and adjoint passes of `exact` (first layer first for the
    statistics, last layer first for the adjoints)."""
    compiled = la_mode(base)

    def pair(updates):
        gather, finish = updates
        return (pytensor.function(inputs, [], updates=gather, mode=compiled,
                                  on_unused_input="ignore"),
                pytensor.function([], [], updates=finish, mode=compiled))

    layers = range(len(exact.layers))
    return {"weight": pytensor.function(inputs, weight, mode=compiled,
                                        on_unused_input="ignore"),
            "window": exact.window,
            "statistics": [pair(exact.statistics_pass(i)) for i in layers],
            "adjoints": [pair(exact.adjoint_pass(i)) for i in reversed(layers)]}


def _check_extra(label: str, extra: UpdatesLike, taken: UpdatesLike, whose: str) -> None:
    """Refuse extra updates of variables that `taken` (another side's updates) updates."""
    clash = [getattr(v, "name", None) or repr(v) for v in extra if v in taken]
    if clash:
        raise ValueError(f"{label} updates {', '.join(clash)}, which {whose} updates too")


def _check_no_batch_inputs(extra: UpdatesLike) -> None:
    """Refuse apply-side updates that need inputs (the apply function has none)."""
    from pytensor.compile.sharedvalue import SharedVariable
    from pytensor.graph.basic import Constant
    from pytensor.graph.traversal import ancestors

    for var, new in extra.items():
        needed = [v for v in ancestors([new]) if v.owner is None
                  and not isinstance(v, (SharedVariable, Constant))]
        if needed:
            names = ", ".join(sorted({getattr(v, "name", None) or repr(v) for v in needed}))
            raise ValueError(
                f"extra_apply_updates: the update of {getattr(var, 'name', None) or var!r} "
                f"needs {names}, an input of the batch, and the apply function has no inputs; "
                "put per-batch updates (running statistics, a random generator's next state) "
                "in extra_accumulate_updates")


def _noise_options(noise_scale: Any) -> dict[str, Any] | None:
    """``compile_accumulation``'s `noise_scale`, checked: None (off) or its options."""
    if noise_scale is False or noise_scale is None:
        return None
    if noise_scale is True:
        return {"population": None, "decay": 0.9}
    if not isinstance(noise_scale, Mapping):
        raise TypeError("noise_scale must be True, False or a dict(population=..., decay=...), "
                        f"got {noise_scale!r}")
    unknown = set(noise_scale) - {"population", "decay"}
    if unknown:
        raise TypeError(f"noise_scale: unknown option(s) {', '.join(sorted(unknown))}; "
                        "its options are population and decay")
    decay = noise_scale.get("decay", 0.9)
    if isinstance(decay, (bool, np.bool_)) or not isinstance(decay, (int, float)) or \
            not 0 <= decay < 1:
        raise ValueError(f"noise_scale: decay must be a number in [0, 1), got {decay!r}")
    return {"population": noise_scale.get("population"), "decay": float(decay)}


def run_epoch(
    trainer: AccumulationTrainer,
    batches: Iterable[Sequence[Any]],
    *,
    progress: bool = True,
    desc: str = "epoch",
) -> float:
    """Feed every batch to ``trainer.step`` and flush the partial window.

    Parameters
    ----------
    trainer : AccumulationTrainer
    batches : sequence of tuples
        Each tuple is one call's inputs.
    progress : bool
        Show a progress bar (tqdm if installed, plain lines otherwise).
    desc : str
        Label of the progress bar.

    Returns
    -------
    float
        The mean of the first output over the batches (the mean loss; with
        ``batch_norm="exact"``, over the windows' mean losses).

    Examples
    --------
    >>> import pytensor, pytensor.tensor as pt
    >>> from lasagne_accum import sgd
    >>> w = pytensor.shared(0.0, name="w")
    >>> x = pt.vector("x")
    >>> trainer = compile_accumulation([x], ((w - x) ** 2).mean(), [w], sgd,
    ...                                dict(learning_rate=0.5), every=2)
    >>> loss = run_epoch(trainer, [([1.0],), ([3.0],), ([2.0],)], progress=False)
    >>> trainer.steps   # one full window and one flushed partial window
    2
    """
    batches = list(batches)
    bar = Progress(batches, desc=desc, enabled=progress)
    losses = []
    for batch in bar:
        out = trainer.step(*batch)
        if out is None:      # batch_norm="exact" holds the batch until its window is complete
            continue
        first = out[0] if isinstance(out, (list, tuple)) else out
        losses.append(float(np.asarray(first)))
        bar.set(f"loss {losses[-1]:.4f}")
    trainer.flush()
    return float(np.mean(losses)) if losses else float("nan")

