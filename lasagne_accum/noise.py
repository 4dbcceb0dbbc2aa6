"""The gradient noise scale, measured by the accumulation window.

A window of K micro-batches holds two batch sizes at once: each micro-batch's
gradient ``g_k`` (``b_k`` examples) and the window's mean ``g`` (``B = sum b_k``
examples). Their squared norms estimate, without bias, the squared norm of the
true gradient ``|G|^2`` and the trace of the per-example gradient covariance
``tr(Sigma)``; their ratio is McCandlish et al.'s simple noise scale
``B_simple = tr(Sigma) / |G|^2``, which predicts the critical batch size.
:func:`gradient_noise` builds the estimates as expressions for the apply
function; ``compile_accumulation(noise_scale=...)`` returns them from each
apply and keeps running averages.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import pytensor.tensor as pt

from ._graph import sum_of_squares

if TYPE_CHECKING:
    from pytensor.tensor.variable import TensorVariable

    from .accumulate import Accumulation

__all__ = ["gradient_noise", "GradientNoise", "NoiseEstimate", "FollowNoiseScale"]


@dataclass(frozen=True)
class GradientNoise:
    """Symbolic estimates from one window (see :func:`gradient_noise`).

    Attributes
    ----------
    grad_sq : TensorVariable
        ``|G|^2``, the squared norm of the true gradient.
    trace : TensorVariable
        ``tr(Sigma)``, the trace of the per-example gradient covariance.
    b_simple : TensorVariable
        ``trace / grad_sq``, in examples.
    """

    grad_sq: TensorVariable
    trace: TensorVariable
    b_simple: TensorVariable

    @property
    def outputs(self) -> list[TensorVariable]:
        """``[grad_sq, trace, b_simple]``, for a function's outputs."""
        return [self.grad_sq, self.trace, self.b_simple]


@dataclass(frozen=True)
class NoiseEstimate:
    """One window's estimates as floats (NaN for a window of one micro-batch)."""

    grad_sq: float
    trace: float
    b_simple: float


def gradient_noise(accu: Accumulation | Any, population: int | None = None) -> GradientNoise:
    """Unbiased estimates of ``|G|^2``, ``tr(Sigma)`` and B_simple from the window.

    Build the apply function with the result's outputs (before its reset
    empties the window)::

        accu, reset = accumulate_gradients(loss, params, weight=n, noise_scale=True)
        noise = gradient_noise(accu)
        apply_fn = pytensor.function([], noise.outputs, updates=...)

    With the window's K micro-batches of ``b_k`` examples (``B = sum b_k``),
    ``A = sum_k b_k |g_k|^2 / B`` (the count-weighted mean of the micro-batches'
    squared gradient norms) and ``L = |g|^2`` (the window's mean gradient):

    * examples drawn independently (`population` None):
      ``tr(Sigma) = B (A - L) / (K - 1)``, ``|G|^2 = (K L - A) / (K - 1)``;
      with K equal micro-batches of b this is ``b K (S - L) / (K - 1)`` and
      ``(K L - S) / (K - 1)``, ``S`` the mean of ``|g_k|^2``;
    * drawn without replacement from a data set of N = `population` examples
      (an epoch of shuffled batches): ``tr(Sigma) = (N - 1) / N * B (A - L) / (K - 1)``,
      ``|G|^2 = L - tr(Sigma) (N - B) / (B (N - 1))``;
    * ``b_simple = tr(Sigma) / |G|^2``.

    Parameters
    ----------
    accu : Accumulation
        The result of ``accumulate_gradients(..., weight=..., noise_scale=True)``
        (or its accumulate dictionary).
    population : int, optional
        The number of examples the micro-batches are drawn from without
        replacement. None assumes independent draws (with replacement, or an
        endless stream); on a finite data set it then underestimates ``|G|^2``
        by about ``tr(Sigma) / (N - 1)``.

    Returns
    -------
    GradientNoise
        Symbolic scalars in the buffers' dtype: ``.grad_sq``, ``.trace``,
        ``.b_simple`` (and ``.outputs``, the three in a list). NaN for a window
        of fewer than two micro-batches (one batch size only: no estimate).
        The estimates of one window are noisy and ``grad_sq`` can come out
        negative; average ``grad_sq`` and ``trace`` over windows separately
        and take the ratio of the averages (what ``compile_accumulation``'s
        ``trainer.noise_scale`` does).

    Raises
    ------
    TypeError
        If `accu` is not an accumulation, or `population` not an integer.
    ValueError
        If the accumulation was built without ``noise_scale=True``, or
        `population` is < 2. At run time, the apply function raises (and
        changes nothing) when a window holds more examples than `population`.

    Notes
    -----
    The expectations: a micro-batch mean of b examples drawn independently
    has ``E|g_b|^2 = |G|^2 + tr(Sigma) / b``, so ``E[A] = |G|^2 + K tr(Sigma) / B``
    and ``E[L] = |G|^2 + tr(Sigma) / B``; solving the two for ``|G|^2`` and
    ``tr(Sigma)`` gives the estimators. Without replacement from N examples,
    ``E|g_b|^2 = |G|^2 + tr(Sigma) (N - b) / (b (N - 1))`` (``Sigma`` the
    covariance of the N per-example gradients, divided by N), which gives the
    corrected pair. Skipped non-finite micro-batches (``skip_nonfinite``) add
    nothing to any sum and do not count in K or B.

    References
    ----------
    .. [1] McCandlish, S., Kaplan, J., Amodei, D. and the OpenAI Dota Team
       (2018): An Empirical Model of Large-Batch Training. arXiv:1812.06162,
       appendix A.

    Examples
    --------
    >>> import numpy as np, pytensor, pytensor.tensor as pt
    >>> import lasagne_accum as la
    >>> w = pytensor.shared(np.zeros(2), name="w")
    >>> x = pt.matrix("x")
    >>> loss = ((x - w) ** 2).sum(axis=1).mean() / 2     # per example: (x - w)
    >>> accu, reset = la.accumulate_gradients(loss, [w], weight=x.shape[0],
    ...                                       noise_scale=True)
    >>> noise = la.gradient_noise(accu)
    >>> step = pytensor.function([x], [], updates=accu)
    >>> estimate = pytensor.function([], noise.outputs, updates=reset)
    >>> for batch in ([[1.0, 0.0], [3.0, 0.0]], [[2.0, 1.0], [2.0, -1.0]]):
    ...     _ = step(np.array(batch))
    >>> grad_sq, trace, b_simple = (float(v) for v in estimate())
    >>> round(grad_sq, 6), round(trace, 6)                     # from |g1|^2 = |g2|^2 = 4
    (4.0, 0.0)
    """
    from .accumulate import Accumulation

    accumulation = getattr(accu, "accumulation", accu)
    if not isinstance(accumulation, Accumulation):
        raise TypeError("gradient_noise(): accu must be the result of accumulate_gradients, "
                        f"got {type(accu).__name__}")
    if accumulation.grad_sq is None:
        raise ValueError("gradient_noise(): the accumulation keeps no squared norms; build it "
                         "with accumulate_gradients(..., weight=..., noise_scale=True)")
    if population is not None:
        if isinstance(population, (bool, np.bool_)) or not isinstance(
                population, (int, np.integer)):
            raise TypeError(f"gradient_noise(): population must be an integer (the number of "
                            f"examples drawn from), got {population!r}")
        if population < 2:
            raise ValueError(f"gradient_noise(): population must be at least 2, got "
                             f"{population}")
    dtype = accumulation.grad_sq.type.dtype
    k = pt.cast(accumulation.count, dtype)
    total = pt.cast(accumulation.total, dtype)
    safe_total = pt.switch(pt.gt(total, 0), total, np.ones((), dtype))
    mean_sq = accumulation.grad_sq / safe_total                          # A
    window_sq = pt.add(*[sum_of_squares(a, dtype) for a in accumulation.accumulators]) \
        / pt.sqr(safe_total)                                             # L
    if population is not None:
        from pytensor.raise_op import Assert

        n = np.asarray(population, dtype)
        total = pt.as_tensor_variable(Assert(
            f"gradient_noise(): population ({population}) is smaller than this window's "
            "batch")(total, pt.le(total, n)))
    km1 = pt.switch(pt.gt(k, 1), k - 1, np.ones((), dtype))
    trace = total * (mean_sq - window_sq) / km1
    if population is None:
        grad_sq = (k * window_sq - mean_sq) / km1
    else:
        trace = trace * (n - 1) / n
        grad_sq = window_sq - trace * (n - total) / (safe_total * (n - 1))
    # each output selects NaN for a window of one batch itself: a ratio of two selects of
    # NaN is simplified by PyTensor's rewrites as x / x = 1
    nan = np.asarray(math.nan, dtype)
    several = pt.ge(k, 2)
    return GradientNoise(grad_sq=pt.switch(several, grad_sq, nan),
                         trace=pt.switch(several, trace, nan),
                         b_simple=pt.switch(several, trace / grad_sq, nan))


class FollowNoiseScale:
    """A batch-size schedule for ``compile_accumulation(every=...)`` that follows B_simple.

    At each window's start it compares the window's batch ``K * batch_size``
    with the measured noise scale ``trainer.noise_scale`` and doubles K when
    B_simple is more than sqrt(2) times the batch, halves it when it is less
    than 1/sqrt(2) times, and keeps it otherwise: K changes only at window
    boundaries, by a factor of two at most, within ``[min_every, max_every]``,
    and stays at `min_every` until a noise scale is measured (a window of two
    or more micro-batches). The noise scale is the critical batch's estimate
    (McCandlish et al. 2018): below it, a larger batch takes proportionally
    fewer steps; above it, more examples for little gain.

    Parameters
    ----------
    batch_size : int
        Examples per micro-batch (b); the window's batch is ``K * b``.
    min_every, max_every : int
        Bounds of K (``min_every >= 2`` keeps every window measuring).
    """

    def __init__(self, batch_size: int, min_every: int = 2, max_every: int = 64) -> None:
        for label, value in (("batch_size", batch_size), ("min_every", min_every),
                             ("max_every", max_every)):
            if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) \
                    or value < 1:
                raise ValueError(f"FollowNoiseScale: {label} must be a positive integer, got "
                                 f"{value!r}")
        if max_every < min_every:
            raise ValueError(f"FollowNoiseScale: max_every ({max_every}) is smaller than "
                             f"min_every ({min_every})")
        self.batch_size, self.min_every, self.max_every = \
            int(batch_size), int(min_every), int(max_every)
        self.trainer: Any = None

    def bind(self, trainer: Any) -> None:
        """Read the noise scale of `trainer` (``compile_accumulation`` calls this)."""
        if trainer.accumulation.grad_sq is None:
            raise ValueError("every=FollowNoiseScale(...) needs the noise scale: pass "
                             "noise_scale=True (and weight=) to compile_accumulation")
        self.trainer = trainer

    def __call__(self, examples: Any) -> int:
        if self.trainer is None:
            raise RuntimeError("FollowNoiseScale is not bound to a trainer: pass it as "
                               "compile_accumulation(every=...)")
        k = min(max(int(self.trainer.window) or self.min_every, self.min_every),
                self.max_every)
        noise = self.trainer.noise_scale
        if noise is not None and math.isfinite(noise) and noise > 0:
            target = noise / self.batch_size
            if target > k * math.sqrt(2):
                k *= 2
            elif target < k / math.sqrt(2):
                k //= 2
        return min(max(k, self.min_every), self.max_every)

    def __repr__(self) -> str:
        return (f"FollowNoiseScale(batch_size={self.batch_size}, min_every={self.min_every}, "
                f"max_every={self.max_every})")
