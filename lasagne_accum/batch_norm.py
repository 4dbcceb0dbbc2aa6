"""Batch normalisation, and its running statistics under accumulation.

:func:`batch_norm` normalises with the batch's statistics (the running ones when
``deterministic=True``) and tags its output with what the running averages
need. Under accumulation each micro-batch is normalised with its own
statistics: a *ghost batch* (Hoffer et al. 2017), what a multi-device run
without synchronised batch norm computes per device. The running averages then
move either once per micro-batch (:func:`batch_norm_updates`, ``"each"``: a
PyTorch loop over micro-batches) or once per window with the window's pooled
statistics (:class:`PooledBatchNorm`, ``"pooled"``: the running averages of one
large batch of the same activations). :class:`ExactBatchNorm` gives the window's
micro-batches the statistics of the whole window instead, the exact large batch.

The running statistics follow PyTorch's ``torch.nn.BatchNorm*`` convention:
``running_mean := (1 - alpha) running_mean + alpha mean`` and
``running_var := (1 - alpha) running_var + alpha var_unbiased`` (``alpha`` is
PyTorch's ``momentum``), so that numbers and checkpoints compare with it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
import pytensor
import pytensor.tensor as pt
from pytensor.compile.sharedvalue import SharedVariable
from pytensor.graph.traversal import ancestors

from ._graph import scalar_state, state_like

if TYPE_CHECKING:
    from pytensor.tensor.variable import TensorVariable

    from ._typing import Updates

__all__ = ["batch_norm", "batch_norm_updates", "batch_norm_layers", "BatchNormStats",
           "PooledBatchNorm", "ExactBatchNorm", "recompute_running_stats"]


@dataclass(frozen=True, eq=False)
class BatchNormStats:
    """What one training-mode :func:`batch_norm` computed, for its running averages.

    Attributes
    ----------
    mean, var : TensorVariable
        The batch's mean and biased variance, over `axes`, in the running
        statistics' shape.
    count : TensorVariable
        The number of values each statistic is over (the product of the
        normalised axes' lengths).
    running_mean, running_var : shared variables
    alpha : float or TensorVariable
        The weight of a new value in the running averages.
    x : TensorVariable
        The layer's input.
    axes : tuple of int
        The axes the statistics are over.
    """

    mean: TensorVariable
    var: TensorVariable
    count: TensorVariable
    running_mean: SharedVariable
    running_var: SharedVariable
    alpha: Any
    x: Any = None
    axes: tuple = ()


def _axes(x, axes) -> tuple[int, ...]:
    if axes == "auto":
        return tuple(a for a in range(x.type.ndim) if a != 1)
    if isinstance(axes, (int, np.integer)):
        axes = (axes,)
    try:
        axes = tuple(int(a) % x.type.ndim for a in axes)
    except TypeError:
        raise TypeError(f"batch_norm(): axes must be 'auto', an int or a tuple of ints, got "
                        f"{axes!r}") from None
    if len(set(axes)) != len(axes) or not axes:
        raise ValueError(f"batch_norm(): axes must name distinct axes of x, got {axes!r}")
    return tuple(sorted(axes))


def _in_layout(v: Any, ndim: int, axes: tuple[int, ...]) -> TensorVariable:
    """A statistic (x's shape without `axes`) in x's layout: a broadcastable axis for each
    normalised one."""
    pattern: list[Any] = []
    kept = 0
    for a in range(ndim):
        if a in axes:
            pattern.append("x")
        else:
            pattern.append(kept)
            kept += 1
    return pt.as_tensor_variable(v).dimshuffle(pattern)


def batch_norm(
    x: TensorVariable,
    gamma: Any,
    beta: Any,
    running_mean: SharedVariable,
    running_var: SharedVariable,
    axes: Any = "auto",
    epsilon: float = 1e-5,
    alpha: float = 0.1,
    deterministic: bool = False,
) -> TensorVariable:
    """Batch normalisation: ``gamma * (x - mean) / sqrt(var + epsilon) + beta``.

    * training (``deterministic=False``): ``mean`` and ``var`` (biased) are the
      batch's, over `axes`;
    * inference (``deterministic=True``): the running statistics.

    The output of a training-mode call carries ``tag.batch_norm`` (a
    :class:`BatchNormStats`), from which :func:`batch_norm_updates` (and
    ``compile_accumulation``) build the running averages' updates, in PyTorch's
    convention:

    * ``running_mean := (1 - alpha) * running_mean + alpha * mean``
    * ``running_var := (1 - alpha) * running_var + alpha * var * n / (n - 1)``
      (the unbiased variance of the n values each statistic is over)

    Parameters
    ----------
    x : symbolic tensor
        The layer's input, for example ``(batch, channels)`` or
        ``(batch, channels, height, width)``.
    gamma, beta : shared variables or expressions
        Scale and shift, in the statistics' shape (x's shape without `axes`):
        ``(channels,)`` for the default axes.
    running_mean, running_var : shared variables
        The running statistics, in the statistics' shape (start them at 0 and
        1, as PyTorch does).
    axes : 'auto', int or tuple of ints
        The axes to normalise over. ``'auto'`` (default): all but the second,
        Lasagne's and PyTorch's layout (one statistic per channel).
    epsilon : float
        Added to the variance before the square root (PyTorch's ``eps``,
        1e-5; Lasagne's default is 1e-4).
    alpha : float
        The weight of a batch's statistics in the running averages
        (PyTorch's ``momentum``, 0.1; Lasagne's ``alpha``, also 0.1).
    deterministic : bool
        Use the running statistics (evaluation), no running update.

    Returns
    -------
    TensorVariable
        Normalised `x`, of its shape and dtype.

    Raises
    ------
    TypeError
        If a running statistic is not a shared variable, or `axes` is not
        'auto', an int or a tuple of ints.
    ValueError
        If the running statistics, `gamma` or `beta` do not have the
        statistics' number of dimensions (or a known length differs), or
        `epsilon` is not positive or `alpha` not in (0, 1].
    AssertionError
        At run time, from a function with :func:`batch_norm_updates`, on a
        training batch whose statistics are over a single value (a batch of
        one example with the default axes): its unbiased variance, which the
        running variance takes, is undefined. Raised before anything changes
        (PyTorch refuses such a batch too).

    Notes
    -----
    Lasagne's ``BatchNormLayer`` keeps ``inv_std = 1 / sqrt(var + epsilon)``
    of the *biased* variance as its running statistic; here ``running_var``
    holds the unbiased variance, as PyTorch does: convert a Lasagne checkpoint
    with ``running_var = 1 / inv_std**2 - epsilon`` (the guide's Lasagne page).

    Examples
    --------
    >>> import numpy as np, pytensor, pytensor.tensor as pt
    >>> import lasagne_accum as la
    >>> x = pt.matrix("x")
    >>> g, b = (pytensor.shared(np.full(2, v), name=n) for v, n in ((1.0, "g"), (0.0, "b")))
    >>> rm, rv = (pytensor.shared(np.full(2, v), name=n) for v, n in ((0.0, "rm"), (1.0, "rv")))
    >>> y = la.batch_norm(x, g, b, rm, rv)
    >>> f = pytensor.function([x], y, updates=la.batch_norm_updates(y))
    >>> f(np.array([[1.0, 2.0], [3.0, 6.0]])).round(3)
    array([[-1., -1.],
           [ 1.,  1.]])
    >>> rm.get_value(), rv.get_value()      # 0.9 * old + 0.1 * (mean, unbiased var)
    (array([0.2, 0.4]), array([1.1, 1.7]))
    """
    x = pt.as_tensor_variable(x)
    for label, stat in (("running_mean", running_mean), ("running_var", running_var)):
        if not isinstance(stat, SharedVariable):
            raise TypeError(f"batch_norm(): {label} must be a shared variable, got "
                            f"{type(stat).__name__}")
    if not (isinstance(epsilon, (int, float)) and epsilon > 0):
        raise ValueError(f"batch_norm(): epsilon must be a positive number, got {epsilon!r}")
    if not (isinstance(alpha, (int, float)) and 0 < alpha <= 1):
        raise ValueError(f"batch_norm(): alpha must be in (0, 1], got {alpha!r}")
    axes = _axes(x, axes)
    kept = [a for a in range(x.type.ndim) if a not in axes]
    stat_shape = [x.type.shape[a] for a in kept]
    known = list(stat_shape)   # each statistic's length, from x or from the first that says
    for label, given in (("gamma", gamma), ("beta", beta), ("running_mean", running_mean),
                         ("running_var", running_var)):
        v = pt.as_tensor_variable(given)
        value_shape = (np.shape(v.get_value(borrow=True)) if isinstance(v, SharedVariable)
                       else v.type.shape)
        if v.type.ndim != len(kept) or any(
                a is not None and b is not None and a != b
                for a, b in zip(value_shape, known)):
            raise ValueError(
                f"batch_norm(): {label} has shape {tuple(value_shape)}, but x normalised over "
                f"axes {axes} (and the arguments before it) give statistics of shape "
                f"{tuple('?' if s is None else s for s in known)}")
        known = [b if a is None else a for a, b in zip(known, value_shape)]

    def expand(v):
        return _in_layout(v, x.type.ndim, axes)

    gamma_x, beta_x = expand(gamma), expand(beta)
    eps = np.asarray(epsilon, dtype=x.type.dtype)       # a Python float would upcast float32
    if deterministic:
        return (x - expand(running_mean)) / pt.sqrt(expand(running_var) + eps) * gamma_x \
            + beta_x
    count = pt.prod([x.shape[a] for a in axes]) if len(axes) > 1 else x.shape[axes[0]]
    mean = x.mean(axis=axes)
    var = pt.sqr(x - expand(mean)).mean(axis=axes)
    out = (x - expand(mean)) / pt.sqrt(expand(var) + eps) * gamma_x + beta_x
    out.tag.batch_norm = BatchNormStats(mean, var, count, running_mean, running_var, alpha,
                                        x, axes)
    return out


def batch_norm_layers(outputs: Any) -> list[BatchNormStats]:
    """Every training-mode :func:`batch_norm` that `outputs` (a loss, a list) depend on,
    in the order of the graph (inputs first)."""
    if not isinstance(outputs, (list, tuple)):
        outputs = [outputs]
    found: list[BatchNormStats] = []
    for v in ancestors(list(outputs)):
        stats = getattr(getattr(v, "tag", None), "batch_norm", None)
        if isinstance(stats, BatchNormStats) and stats not in found:
            found.append(stats)
    return found[::-1]


def _running(stats: BatchNormStats, mean, var_unbiased, valid=None) -> Updates:
    """The running averages' updates; with `valid`, each reads its old value through a
    check of it, so that a failed check raises before any of them is written (in place)."""
    rm, rv = stats.running_mean, stats.running_var
    old_m: Any = rm
    old_v: Any = rv
    if valid is not None:
        from pytensor.raise_op import Assert

        check = Assert("batch_norm(): a training batch's statistics are over one value (a "
                       "batch of one example?): its unbiased variance, which the running "
                       "variance takes, is undefined; use batches of two or more")
        old_m, old_v = check(rm, valid), check(rv, valid)
    a = stats.alpha
    return OrderedDict([(rm, pt.cast((1 - a) * old_m + a * mean, rm.type.dtype)),
                        (rv, pt.cast((1 - a) * old_v + a * var_unbiased, rv.type.dtype))])


def batch_norm_updates(outputs: Any) -> Updates:
    """The running averages' updates of every training-mode :func:`batch_norm` in `outputs`.

    One update per call of the function they go into: in the accumulate
    function, once per micro-batch (``running_stats="each"``, what a PyTorch
    loop over micro-batches does); in a plain training function, once per batch.

    Parameters
    ----------
    outputs : symbolic variable or list
        The loss (or outputs) the batch-norm layers feed.

    Returns
    -------
    OrderedDict
        ``{running_mean: ..., running_var: ...}`` for each layer (see
        :func:`batch_norm` for the formulas).
    """
    updates: Updates = OrderedDict()
    for stats in batch_norm_layers(outputs):
        n = pt.cast(stats.count, stats.var.type.dtype)
        updates.update(_running(stats, stats.mean, stats.var * n / (n - 1),
                                valid=pt.gt(stats.count, 1)))
    return updates


class PooledBatchNorm:
    """Running averages updated once per window, with the window's pooled statistics.

    The accumulate function adds each micro-batch's ``n * mean`` and
    ``n * (var + mean^2)`` (per channel, ``n`` its number of values) and ``n``
    to buffers (:attr:`accumulate`); the apply function moves the running
    averages once with the window's mean and unbiased variance (the law of
    total variance: exact for micro-batches of unequal sizes) and resets the
    buffers (:attr:`apply`, guarded: nothing moves on an empty window). The
    result equals the running averages of one batch made of the window's
    activations.

    Parameters
    ----------
    outputs : symbolic variable or list
        The loss the batch-norm layers feed.
    is_step : symbolic boolean scalar
        The apply function's step signal (``accu.is_step``).
    name : str
        Prefix of the buffers' names.
    """

    def __init__(self, outputs: Any, is_step: Any, name: str = "pooled") -> None:
        self.layers = batch_norm_layers(outputs)
        self.accumulate: Updates = OrderedDict()
        self.apply: Updates = OrderedDict()
        #: per layer, the buffers (sum of values, sum of squares, count)
        self.buffers: list[tuple[SharedVariable, SharedVariable, SharedVariable]] = []
        for i, stats in enumerate(self.layers):
            rm = stats.running_mean
            dtype = rm.type.dtype
            first = state_like(rm, f"{name}_sum", i, dtype=dtype)
            second = state_like(rm, f"{name}_sumsq", i, dtype=dtype)
            count = scalar_state(f"{rm.name or f'batch_norm{i}'}.{name}_count", dtype)
            n = pt.cast(stats.count, dtype)
            self.accumulate[first] = first + n * stats.mean
            self.accumulate[second] = second + n * (stats.var + pt.sqr(stats.mean))
            self.accumulate[count] = count + n
            self.buffers.append((first, second, count))
            total = pt.switch(pt.gt(count, 1), count, np.asarray(2, dtype))
            mean = first / total
            var = (second / total - pt.sqr(mean)) * total / (total - 1)
            for v, new in _running(stats, mean, var).items():
                self.apply[v] = pt.switch(is_step, new, v)
            zero: Any = np.zeros((), dtype)
            self.apply[first] = pt.zeros_like(first)
            self.apply[second] = pt.zeros_like(second)
            self.apply[count] = zero


def recompute_running_stats(inputs: Sequence[Any], outputs: Any, batches: Any,
                            mode: Any = None) -> int:
    """Set the running statistics to the mean and unbiased variance over `batches`.

    After :class:`~lasagne_accum.ModelAverage` or the EMA swaps averaged weights
    in, the running statistics still belong to the raw weights: recompute them
    on a few training batches (what PyTorch's ``torch.optim.swa_utils.update_bn``
    does; it averages each batch's statistics, while here they are pooled over
    all the batches' values, exact for batches of unequal sizes). Layers are
    in training mode for the passes (each normalises with its batch's
    statistics), as in PyTorch.

    Parameters
    ----------
    inputs : list of symbolic variables
        The inputs `outputs` need (the batch).
    outputs : symbolic variable or list
        What the batch-norm layers feed (the training loss, say: its graph
        must use the training-mode layers).
    batches : iterable of tuples
        Each tuple is one call's inputs.
    mode : str or Mode, optional
        Compiled through :func:`lasagne_accum.mode` (default C).

    Returns
    -------
    int
        The number of batch-norm layers whose statistics were set.

    Raises
    ------
    ValueError
        If `outputs` depend on no training-mode batch-norm layer, or
        `batches` is empty.

    Examples
    --------
    >>> import numpy as np, pytensor, pytensor.tensor as pt
    >>> import lasagne_accum as la
    >>> from lasagne_accum.batch_norm import recompute_running_stats
    >>> x = pt.matrix("x")
    >>> sh = lambda v, n: pytensor.shared(np.array(v, dtype="float64"), name=n)
    >>> rm, rv = sh([0.0], "rm"), sh([1.0], "rv")
    >>> y = la.batch_norm(x, sh([1.0], "g"), sh([0.0], "b"), rm, rv)
    >>> recompute_running_stats([x], y, [(np.array([[1.0], [2.0]]),), (np.array([[6.0]]),)])
    1
    >>> rm.get_value(), rv.get_value()          # mean and unbiased variance of 1, 2, 6
    (array([3.]), array([7.]))
    """
    import pytensor

    from .modes import mode as la_mode

    layers = batch_norm_layers(outputs)
    if not layers:
        raise ValueError("recompute_running_stats(): outputs depend on no training-mode "
                         "batch_norm()")
    pooled = PooledBatchNorm(outputs, pt.constant(True), name="recompute")
    gather = pytensor.function(list(inputs), [], updates=pooled.accumulate,
                               mode=la_mode(mode or "CVM"))
    calls = 0
    for batch in batches:
        gather(*batch)
        calls += 1
    if not calls:
        raise ValueError("recompute_running_stats(): batches is empty")
    final: Updates = OrderedDict()
    for stats, buffers in zip(layers, pooled.buffers):
        first, second, count = (pt.as_tensor_variable(v) for v in buffers)
        mean = first / count
        var = (second / count - pt.sqr(mean)) * count / (count - 1)
        final[stats.running_mean] = pt.cast(mean, stats.running_mean.type.dtype)
        final[stats.running_var] = pt.cast(var, stats.running_var.type.dtype)
    pytensor.function([], [], updates=final, mode=la_mode(mode or "CVM"))()
    return len(layers)


class ExactBatchNorm:
    """The passes that give a window's batch-norm layers the statistics of the whole window.

    With the window's micro-batches held, the large batch's gradient is computed exactly,
    for any number of batch-norm layers, in ``2 L + 1`` passes over them (L layers):

    1. statistics, layer by layer (l = 1..L): each pass sums the layer's input over
       the micro-batches, the earlier layers normalised with the window's statistics
       found before; the window's mean and biased variance are then fixed;
    2. adjoints, layer by layer (l = L..1): the derivative of the window's loss with
       respect to the layer's mean and variance (each micro-batch's share, summed), the
       later layers' statistics entering through their adjoints found before;
    3. gradients: each micro-batch's gradient of the surrogate
       ``loss + sum_l (a_l . mean_l + b_l . var_l)`` with the statistics held fixed, into
       the accumulation's buffers: their weighted sum is the large batch's gradient (the
       chain rule through the statistics, with ``a_l``, ``b_l`` the adjoints).

    Built by ``compile_accumulation(batch_norm="exact")``, which compiles the passes
    and holds the micro-batches (:class:`~lasagne_accum.training.ExactTrainer`).

    Parameters
    ----------
    loss : symbolic scalar
        The micro-batch's loss, a mean over its examples, with training-mode layers.
    weight : symbolic scalar
        The micro-batch's number of examples.
    """

    def __init__(self, loss: Any, weight: Any) -> None:
        from pytensor.graph.replace import graph_replace

        self.layers = batch_norm_layers(loss)
        if not self.layers:
            raise ValueError("ExactBatchNorm: the loss depends on no training-mode batch_norm()")
        dtype = self.layers[0].running_mean.type.dtype
        #: the window's total weight, set before the passes
        self.window = scalar_state("batch_norm.window_total", dtype, 1.0)
        self.means, self.vars, self.adj_mean, self.adj_var = [], [], [], []
        #: per layer, the number of values the window's statistics are over
        self.n_values = []
        for i, st in enumerate(self.layers):
            rm = st.running_mean
            self.n_values.append(scalar_state(f"{rm.name or f'batch_norm{i}'}.window_values",
                                              dtype, 2.0))
            self.means.append(state_like(rm, "window_mean", i))
            self.vars.append(state_like(rm, "window_var", i, value=1.0))
            self.adj_mean.append(state_like(rm, "window_mean_adjoint", i))
            self.adj_var.append(state_like(rm, "window_var_adjoint", i))
        replace: dict[Any, Any] = {}
        for st, m, v in zip(self.layers, self.means, self.vars):
            replace[st.mean] = m
            replace[st.var] = v
        #: the layers' batch statistics -> the window's (shared variables)
        self.replace = replace
        cloned: Any = graph_replace([loss, *[st.x for st in self.layers]], replace,
                                    strict=False)
        self.loss, self.inputs = cloned[0], cloned[1:]
        w = pt.cast(weight, dtype)
        self.weight = w

    def with_window_statistics(self, outputs: Sequence[Any]) -> list[Any]:
        """`outputs` of the training graph, with the window's statistics in every layer."""
        from pytensor.graph.replace import graph_replace

        return list(graph_replace(list(outputs), self.replace, strict=False))

    def _expand(self, i, v):
        st = self.layers[i]
        return _in_layout(v, st.x.type.ndim, st.axes)

    def _terms(self, i, adj_m, adj_v):
        """``(a . sum h + b . sum (h - mean)^2) / weight`` of layer i, summed over examples."""
        h = self.inputs[i]
        axes = self.layers[i].axes
        first = (self._expand(i, adj_m) * h).sum(axis=axes).sum()
        second = (self._expand(i, adj_v) * pt.sqr(h - self._expand(i, self.means[i]))
                  ).sum(axis=axes).sum()
        return (first + second) / self.weight

    def surrogate(self, after: int = -1) -> TensorVariable:
        """The micro-batch's surrogate loss, with the adjoint terms of the layers after
        `after` (-1: all): its weighted mean over the window has the large batch's
        gradient (statistics held fixed)."""
        out: Any = self.loss
        for i in range(after + 1, len(self.layers)):
            out = out + self._terms(i, self.adj_mean[i], self.adj_var[i])
        return out

    def statistics_pass(self, i: int) -> tuple[Any, Any]:
        """Pass 1 for layer i: the accumulate updates of its sums, and the updates that
        turn them into the window's mean and biased variance (and zero them)."""
        st = self.layers[i]
        h: Any = self.inputs[i]
        rm = st.running_mean
        dtype = rm.type.dtype
        total = state_like(rm, "window_sum", i)
        total_sq = state_like(rm, "window_sumsq", i)
        count = scalar_state(f"{rm.name or f'batch_norm{i}'}.window_count", dtype)
        n = pt.cast(pt.prod([h.shape[a] for a in st.axes]), dtype)
        gather = OrderedDict([(total, total + h.sum(axis=st.axes)),
                              (total_sq, total_sq + pt.sqr(h).sum(axis=st.axes)),
                              (count, count + n)])
        mean = total / count
        finish = OrderedDict([(self.means[i], mean),
                              (self.vars[i], total_sq / count - pt.sqr(mean)),
                              (self.n_values[i], count),
                              (total, pt.zeros_like(total)), (total_sq, pt.zeros_like(total_sq)),
                              (count, np.zeros((), dtype))])
        return gather, finish

    def adjoint_pass(self, i: int) -> tuple[Any, Any]:
        """Pass 2 for layer i: the accumulate updates of its adjoints (each micro-batch's
        weighted share), and the updates that fix them (and zero the sums)."""
        rm = self.layers[i].running_mean
        sums = [state_like(rm, "window_mean_adjoint_sum", i),
                state_like(rm, "window_var_adjoint_sum", i)]
        share = self.weight / pt.cast(self.window, self.weight.type.dtype)
        grads: Any = pytensor.grad(self.surrogate(after=i), [self.means[i], self.vars[i]])
        gather = OrderedDict((s, s + share * g) for s, g in zip(sums, grads))
        finish = OrderedDict([(self.adj_mean[i], sums[0]), (self.adj_var[i], sums[1]),
                              (sums[0], pt.zeros_like(sums[0])),
                              (sums[1], pt.zeros_like(sums[1]))])
        return gather, finish

    def running_updates(self, is_step: Any) -> Updates:
        """The running averages moved once by the window's mean and unbiased variance."""
        out: Updates = OrderedDict()
        for i, st in enumerate(self.layers):
            n = self.n_values[i]
            var = self.vars[i] * n / (n - 1)
            for v, new in _running(st, self.means[i], var).items():
                out[v] = pt.switch(is_step, new, v)
        return out
