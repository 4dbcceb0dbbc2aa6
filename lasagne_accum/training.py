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

from .accumulate import accumulate_gradients
from .backends import blas_available, default_modes
from .compiling import use_parallel_compile, use_precompiled_headers
from .grads import check_every, check_rule_updates
from .progress import Progress

if TYPE_CHECKING:
    from pytensor.graph.basic import Variable

    from .accumulate import Accumulation
    from ._typing import Params, PathLike, Scalar, UpdateRule, UpdatesLike

__all__ = ["compile_accumulation", "AccumulationTrainer", "run_epoch", "Progress",
           "default_modes", "blas_available", "use_precompiled_headers",
           "use_parallel_compile"]


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
    every : int
        Batches per optimizer step.
    steps : int
        Optimizer steps taken through :meth:`step` and :meth:`flush`.
    apply_updates : OrderedDict
        The apply function's update dictionary (rule state included), for
        :func:`lasagne_accum.save_state`.
    """

    def __init__(
        self,
        accumulate_fn: Callable[..., Any],
        apply_fn: Callable[[], Any],
        accumulation: Accumulation,
        every: int,
        apply_updates: UpdatesLike | None = None,
    ) -> None:
        self.accumulate_fn = accumulate_fn
        self.apply_updates = apply_updates if apply_updates is not None else {}
        self.apply_fn = apply_fn
        self.accumulation = accumulation
        self.every = every
        self.steps = 0
        self._pending: int | None = None  # batches in the window; read from the counter when None

    @property
    def pending(self) -> int:
        """Batches accumulated and not yet applied (read from the counter)."""
        return int(np.asarray(self.accumulation.count.get_value()))

    def step(self, *batch: Any) -> Any:
        """Accumulate one batch; apply when `every` batches are in.

        Returns
        -------
        The accumulate function's outputs for this batch (the loss).
        """
        if self._pending is None:
            self._pending = self.pending
        out = self.accumulate_fn(*batch)
        if self.accumulation.skipped is None:
            self._pending += 1
        else:  # a skipped batch does not count: read the real counter
            self._pending = self.pending
        if self._pending >= self.every:
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

    def save(self, path: PathLike, *more: Any) -> list[str]:
        """Checkpoint everything the two functions update (and `more`).

        See :func:`lasagne_accum.save_state`; a mid-window checkpoint resumes
        the window where it stopped.
        """
        from .state import save_state

        return save_state(path, self, *more)

    def load(self, path: PathLike, *more: Any) -> list[str]:
        """Load a checkpoint written by :meth:`save` and resume its window."""
        from .state import load_state

        names = load_state(path, self, *more)
        self._pending = None
        return names

    def _apply(self):
        self.apply_fn()
        self.steps += 1
        self._pending = 0


def compile_accumulation(
    inputs: Sequence[Variable],
    loss: Variable,
    params: Params,
    update_rule: UpdateRule,
    rule_kwargs: Mapping[str, Any] | None = None,
    every: int = 1,
    *,
    weight: Scalar | None = None,
    average: bool = True,
    max_norm: Scalar | None = None,
    skip_nonfinite: bool = False,
    outputs: Sequence[Variable] | None = None,
    extra_apply_updates: UpdatesLike | None = None,
    mode: Any = None,
    apply_mode: Any = None,
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
    every : int
        Batches per optimizer step (N).
    weight : symbolic scalar, optional
        The batch's weight (its number of examples), for an exact mean over
        batches of different sizes; must be computable from `inputs`.
    average, max_norm, skip_nonfinite
        Passed to :func:`lasagne_accum.accumulate_gradients`.
    outputs : list of symbolic variables, optional
        Outputs of the per-batch function; default ``[loss]``.
    extra_apply_updates : dict or callable, optional
        More updates for the apply function, so that they run once per
        optimizer step. A callable receives the rule's update dictionary and
        returns the extra updates: ``lambda apply: ModelAverage(params, 0.15,
        updates=apply).updates`` averages the values after each step.
    mode, apply_mode : str or Mode, optional
        Compilation modes of the two functions; by default
        :func:`default_modes`. Give `mode` alone to use it for both.
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
        :func:`accumulate_gradients`).

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
    every = check_every(every, "every")
    if not callable(update_rule):
        raise TypeError(f"update_rule must be callable, got {type(update_rule).__name__}")
    acc = accumulate_gradients(loss, params, average=average, weight=weight,
                               max_norm=max_norm, skip_nonfinite=skip_nonfinite, name=name)
    apply = check_rule_updates(update_rule, acc.grads, acc.params, dict(rule_kwargs or {}))
    if callable(extra_apply_updates):
        # e.g. lambda apply: ModelAverage(params, ..., updates=apply).updates, so that
        # the average takes the parameters' values after the step
        extra_apply_updates = extra_apply_updates(OrderedDict(apply))
    if extra_apply_updates:
        for var, new in extra_apply_updates.items():
            if var in apply:
                raise ValueError(f"extra_apply_updates updates {var}, which the rule updates too")
            apply[var] = new
    apply = acc.guard(apply)
    apply.update(acc.reset)

    default_acc, default_apply = default_modes()
    if mode is not None and apply_mode is None:
        apply_mode = mode
    accumulate_fn = pytensor.function(
        list(inputs), loss if outputs is None else list(outputs), updates=acc.accumulate,
        mode=mode or default_acc,
    )
    apply_fn = pytensor.function([], [], updates=apply, mode=apply_mode or default_apply)
    return AccumulationTrainer(accumulate_fn, apply_fn, acc, every, apply_updates=apply)


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
        The mean of the first output over the batches (the mean loss).

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
        first = out[0] if isinstance(out, (list, tuple)) else out
        losses.append(float(np.asarray(first)))
        bar.set(f"loss {losses[-1]:.4f}")
    trainer.flush()
    return float(np.mean(losses)) if losses else float("nan")

