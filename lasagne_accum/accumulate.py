"""Gradient accumulation: the two-function form.

One compiled function adds each mini-batch's gradient into a buffer; another,
called every N-th batch, applies any update rule to the accumulated gradient
and resets the buffer::

    accu, reset = accumulate_gradients(loss, params, weight=batch_size)
    apply = adam(accu.grads, params, learning_rate=1e-3)   # any rule
    apply.update(reset)
    step_fn = pytensor.function([x, y, batch_size], loss, updates=accu)
    apply_fn = pytensor.function([], [], updates=apply)

The buffers hold weighted *sums*; the mean is taken at apply time by dividing
by the total weight actually accumulated, so a window of batches of different
sizes (the short last batch of an epoch) gives exactly the gradient of the
concatenated batch. An apply on an empty window changes nothing: the rules of
this library guard their updates when given ``accu.grads``.

Both accumulation forms (this one and the single-function form of
:mod:`lasagne_accum.single_function`) build their buffers, counters, weighting,
non-finite check, mean and clipping with one private core,
:class:`_GradientBuffer`.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Iterator

import numpy as np
import pytensor.tensor as pt
from pytensor.compile.sharedvalue import SharedVariable

from ._checks import check_params, param_label
from ._graph import accumulator_dtype, get_or_compute_grads, guard_updates, hyperparameter, \
    scalar_state, state_like, sum_of_squares
from .constraints import total_norm_constraint

if TYPE_CHECKING:
    from pytensor.tensor.variable import TensorVariable

    from ._typing import LossOrGrads, Params, Scalar, Updates, UpdatesLike

_ZERO_INT = np.int64(0)

__all__ = ["accumulate_gradients", "reset", "Accumulation", "AccumulateUpdates"]


def reset(variables: SharedVariable | Iterable[SharedVariable]) -> Updates:
    """Return an update dictionary that sets every variable to zero.

    Parameters
    ----------
    variables : iterable of shared variables, or a dict
        The variables to zero (for a dict, its keys: ``reset(accu)`` zeroes
        everything an accumulate dictionary updates).

    Returns
    -------
    OrderedDict
        ``{v: zeros_like(v)}`` for every variable, keeping its dtype and
        static shape.

    Raises
    ------
    TypeError
        If an element is not a shared variable.

    Examples
    --------
    >>> import numpy as np, pytensor
    >>> a = pytensor.shared(np.arange(3.0), name="a")
    >>> f = pytensor.function([], [], updates=reset([a]))
    >>> _ = f()
    >>> a.get_value()
    array([0., 0., 0.])
    """
    if isinstance(variables, SharedVariable):
        variables = [variables]
    out: Updates = OrderedDict()
    for i, var in enumerate(variables):
        if not isinstance(var, SharedVariable):
            raise TypeError(
                f"reset(): variables[{i}] ({param_label(var, i)}) is not a shared variable"
            )
        out[var] = pt.zeros_like(var)
    return out


#: a weight gradient ``A @ B`` (m x n) of a parameter whose two sides are at least this long
#: has its squared norm computed from the k x k Gram matrices of its factors
GRAM_MIN_SIDE = 128


def squared_norm(grad: TensorVariable, param: SharedVariable, dtype: str) -> TensorVariable:
    """``|grad|^2`` in `dtype`, without computing `grad` itself where it is a large product.

    A dense layer's weight gradient is a matrix product ``A @ B`` (``A`` m x k,
    ``B`` k x n, k the batch). Its squared Frobenius norm equals
    ``sum((A^T A) * (B B^T))``, two k x k Gram matrices: for a parameter at least
    :data:`GRAM_MIN_SIDE` long on each side, that leaves ``A @ B`` to the in-place
    ``Gemm`` that adds it into the buffer, instead of computing it into a temporary
    (a parameter-sized write and two reads per micro-batch). Its cost grows as
    ``k^2 (m + n)``.

    The Gram sum is tagged: in the C and Numba modes of :func:`lasagne_accum.mode`
    the product's gemm and the sum become one
    :class:`~lasagne_accum._pytensor.gemm_squares.GemmSquares`, which takes the
    Gram matrices for small batches and, for larger ones, squares the product on
    its way into the buffer (chosen at each call from the batch).
    """
    from pytensor.tensor.blockwise import Blockwise
    from pytensor.tensor.math import Dot

    node = grad.owner
    op = getattr(node, "op", None)
    core = op.core_op if isinstance(op, Blockwise) else op
    shape = np.shape(param.get_value(borrow=True))
    if isinstance(core, Dot) and len(shape) == 2 and min(shape) >= GRAM_MIN_SIDE and \
            all(i.type.ndim == 2 for i in node.inputs):
        from ._pytensor.gemm_squares import TAG

        a, b = (pt.cast(i, dtype) for i in node.inputs)
        out = (pt.dot(a.T, a) * pt.dot(b, b.T)).sum()
        setattr(out.tag, TAG, True)
        return out
    return sum_of_squares(grad, dtype)


class _GradientBuffer:
    """The gradient-buffer core shared by both accumulation forms (private).

    Checks the inputs and builds, once: one buffer per parameter (float32 at
    least), the int64 batch counter ``<name>.count``, the total weight
    ``<name>.total`` (with `weight`), the ``<name>.skipped`` counter (with
    `skip_nonfinite`), each batch's contribution ``weight * gradient`` (zero
    for a skipped batch) and, from buffer sums and a denominator, the
    gradients handed to the rule (:meth:`gradients`).
    """

    def __init__(self, loss_or_grads, params, *, average, weight, max_norm, skip_nonfinite,
                 name, default_name, where, noise_scale=False):
        params = check_params(params)
        grads = get_or_compute_grads(loss_or_grads, params)
        if not params:
            raise ValueError(f"{where}() needs at least one parameter")
        if not isinstance(average, (bool, np.bool_)):
            raise TypeError(f"average must be True or False, got {average!r}")
        if not isinstance(skip_nonfinite, (bool, np.bool_)):
            raise TypeError(f"skip_nonfinite must be True or False, got {skip_nonfinite!r}")
        if not isinstance(name, str) or not name:
            raise TypeError(f"name must be a non-empty string, got {name!r}")
        self.params, self.average, self.max_norm = params, bool(average), max_norm
        acc_dtypes = [accumulator_dtype(p.type.dtype) for p in params]
        self.total_dtype = np.result_type(*acc_dtypes).name

        self.weight = None
        if weight is not None:
            w = hyperparameter(weight, "weight", self.total_dtype, low=0)
            if w.owner is None and hasattr(w, "data") and float(w.data) == 0:
                raise ValueError(
                    "weight must be positive, got 0: a batch of weight 0 adds nothing, and "
                    "a window of them has no mean; leave such a batch out"
                )
            self.weight = w
        if max_norm is not None:
            hyperparameter(max_norm, "max_norm", self.total_dtype, low=0)

        suffix = "grad_accu" if name == default_name else f"{name}_grad_accu"
        self.accumulators = [state_like(p, suffix, i, dtype=d)
                             for i, (p, d) in enumerate(zip(params, acc_dtypes))]
        self.count = scalar_state(f"{name}.count", "int64")
        self.total = (scalar_state(f"{name}.total", self.total_dtype)
                      if self.weight is not None else None)

        contributions = []
        for g, acc in zip(grads, self.accumulators):
            dtype = acc.type.dtype
            g = g if g.type.dtype == dtype else pt.cast(g, dtype)
            contributions.append(g if self.weight is None else pt.cast(self.weight, dtype) * g)
        self.skipped = None
        self.finite = None
        self.increment = pt.constant(np.int64(1))
        self.added_weight = self.weight
        if skip_nonfinite:
            # What enters the buffer is checked (weight included): a finite
            # gradient times a large weight can still overflow to inf.
            finite = pt.all([pt.all(pt.isfinite(c)) for c in contributions])
            contributions = [pt.switch(finite, c, pt.zeros_like(c)) for c in contributions]
            self.skipped = scalar_state(f"{name}.skipped", "int64")
            self.increment = pt.cast(finite, "int64")
            if self.weight is not None:
                self.added_weight = pt.switch(finite, self.weight,
                                              np.zeros((), self.total_dtype))
            self.finite = finite
        self.contributions = contributions
        self.grad_sq = None
        self.added_grad_sq = None
        if not isinstance(noise_scale, (bool, np.bool_)):
            raise TypeError(f"noise_scale must be True or False, got {noise_scale!r}")
        if noise_scale:
            if self.weight is None:
                raise ValueError(
                    f"{where}(): noise_scale=True needs weight= (the number of examples in "
                    "each micro-batch): the gradient noise scale is measured in examples")
            # w_k |g_k|^2, g_k this micro-batch's mean gradient: the count-weighted sum of
            # squared norms (nothing for a skipped batch)
            w = pt.cast(self.weight, self.total_dtype)
            sq = pt.add(*[squared_norm(g, p, self.total_dtype) for g, p in zip(grads, params)])
            if self.finite is not None:
                sq = pt.switch(self.finite, sq, np.zeros((), self.total_dtype))
            self.grad_sq = scalar_state(f"{name}.grad_sq", self.total_dtype)
            self.added_grad_sq = w * sq

    def counter_updates(self, updates):
        """Add the skipped counter's update (skipped batches are never reset)."""
        if self.skipped is not None:
            updates[self.skipped] = self.skipped + (np.int64(1) - self.increment)

    def gradients(self, sums, denominator):
        """The gradients for the rule: ``sums / denominator`` (or the sums), clipped.

        A zero denominator (an empty window) gives zero gradients, not 0/0.

        Returns
        -------
        (grads, norm) : list of expressions in the params' dtypes, and the
            total norm before clipping (None without `max_norm`).
        """
        if self.average:
            denominator = pt.cast(denominator, self.total_dtype)
            one = np.ones((), self.total_dtype)
            safe = pt.switch(pt.gt(denominator, 0), denominator, one)
            means = [s / pt.cast(safe, s.type.dtype) for s in sums]
        else:
            means = list(sums)
        grads = [m if m.type.dtype == p.type.dtype else pt.cast(m, p.type.dtype)
                 for m, p in zip(means, self.params)]
        norm = None
        if self.max_norm is not None:
            grads, norm = total_norm_constraint(grads, self.max_norm, return_norm=True)
        return grads, norm


class AccumulateUpdates(OrderedDict):
    """The accumulate update dictionary; also carries the accumulation's results.

    Attributes
    ----------
    grads : list of TensorVariable
        The accumulated gradients, one per parameter (see
        :class:`Accumulation`).
    count : shared int64 scalar
        The number of batches accumulated in the current window.
    accumulation : Accumulation
        The object this dictionary belongs to.
    total, skipped, norm, grad_sq, is_step, guard
        As on :class:`Accumulation`.
    """

    accumulation: Accumulation = None  # type: ignore[assignment]  # set by accumulate_gradients

    @property
    def grads(self) -> list[TensorVariable]:
        return self.accumulation.grads

    @property
    def count(self) -> SharedVariable:
        return self.accumulation.count

    @property
    def total(self) -> SharedVariable:
        return self.accumulation.total

    @property
    def skipped(self) -> SharedVariable | None:
        return self.accumulation.skipped

    @property
    def norm(self) -> TensorVariable | None:
        return self.accumulation.norm

    @property
    def grad_sq(self) -> SharedVariable | None:
        return self.accumulation.grad_sq

    @property
    def is_step(self) -> TensorVariable:
        return self.accumulation.is_step

    def guard(self, updates: UpdatesLike) -> Updates:
        """See :meth:`Accumulation.guard`."""
        return self.accumulation.guard(updates)


@dataclass(frozen=True, eq=False)
class Accumulation:
    """The result of :func:`accumulate_gradients`: unpacks as ``(accumulate, reset)``.

    Unpacks (and indexes) as a pair of OrderedDicts, as in Lasagne's design
    discussion, and carries what the apply function needs. Frozen: its
    attributes cannot be reassigned.

    Attributes
    ----------
    accumulate : AccumulateUpdates
        Update dictionary for the per-batch function.
    reset : OrderedDict
        Update dictionary that zeroes the buffers, counters and total; merge it
        into the apply function's updates. (The buffers are zeroed by a select
        on the counter, which PyTensor fuses into the rule's step.)
    grads : list of TensorVariable
        Symbolic accumulated gradients, one per parameter, in the parameter's
        dtype: the weighted mean ``sum_k w_k g_k / sum_k w_k`` when
        ``average=True`` (with ``w_k = 1`` when no weight was given), else the
        weighted sum. Clipped to `max_norm` when given. Each carries
        ``tag.accumulation`` (this object), by which the rules recognise them,
        in this list or a copy of it, and guard their updates.
    norm : TensorVariable or None
        The total L2 norm of the accumulated gradients before clipping, when
        `max_norm` was given.
    count : shared int64 scalar
        Batches accumulated in the current window (skipped ones excluded).
    total : shared float scalar
        Total weight accumulated in the current window (equals `count` when no
        weight is given).
    skipped : shared int64 scalar or None
        With ``skip_nonfinite=True``: batches skipped since the start because
        a gradient was not finite (never reset).
    accumulators : list of shared variables
        One buffer per parameter (``W.grad_accu``), float32 at least.
    grad_sq : shared float scalar or None
        With ``noise_scale=True``: ``sum_k w_k |g_k|^2`` over the window's
        micro-batches (``g_k`` a micro-batch's mean gradient, ``w_k`` its
        weight), what :func:`lasagne_accum.gradient_noise` needs besides the
        buffers; reset with them.
    params : list of shared variables
    is_step : symbolic boolean scalar
        The step signal of the apply function: ``count > 0``. Pass it as
        ``is_step=`` to :class:`lasagne_accum.ModelAverage` when its updates
        go into the apply function of a hand-written rule; the library's
        rules tag their guarded updates with it already.
    """

    accumulate: AccumulateUpdates
    reset: Updates
    grads: list[TensorVariable]
    norm: TensorVariable | None
    count: SharedVariable
    total: SharedVariable
    skipped: SharedVariable | None
    accumulators: list[SharedVariable]
    params: list[SharedVariable]
    is_step: TensorVariable
    grad_sq: SharedVariable | None = None

    def __iter__(self) -> Iterator[OrderedDict]:
        return iter((self.accumulate, self.reset))

    def __len__(self) -> int:
        return 2

    def __getitem__(self, index: int) -> OrderedDict:
        return (self.accumulate, self.reset)[index]

    def __repr__(self) -> str:
        return (f"Accumulation(params={[p.name for p in self.params]}, "
                f"count={self.count.name!r})")

    def guard(self, updates: UpdatesLike) -> Updates:
        """Make `updates` a no-op when nothing has been accumulated.

        Every update ``v: new`` becomes ``v: switch(count > 0, new, v)``: an
        apply function built from the result changes nothing (no step counted,
        no NaN, no rule state advanced) when called on an empty window, for
        example by an end-of-epoch flush right after a full window. The rules
        of :mod:`lasagne_accum.updates` do this by themselves when given
        ``accu.grads``; call it for a rule of your own. Updates guarded
        already are left as they are, so guarding twice costs nothing.

        Parameters
        ----------
        updates : dict
            The apply dictionary (the rule's updates, usually with `reset`
            merged in).

        Returns
        -------
        OrderedDict
            Each new value carries the step signal (``value.tag.step_signal``),
            which :class:`lasagne_accum.ModelAverage` reads.
        """
        return guard_updates(updates, self.is_step)


def accumulate_gradients(
    loss_or_grads: LossOrGrads,
    params: Params,
    *,
    average: bool = True,
    weight: Scalar | None = None,
    max_norm: Scalar | None = None,
    skip_nonfinite: bool = False,
    noise_scale: bool = False,
    name: str = "accumulate",
) -> Accumulation:
    """Accumulate gradients over mini-batches for a later update.

    Returns the update dictionary of the per-batch function and the reset
    dictionary for the apply function. Per batch (call of the first function):

    * ``accu_i := accu_i + weight * gradient_i`` for every parameter i
    * ``total := total + weight``, ``count := count + 1``

    and the accumulated gradient handed to the update rule is

    * ``grads_i = accu_i / total`` (``average=True``) or ``accu_i``
      (``average=False``), then rescaled by :func:`total_norm_constraint` to
      `max_norm` if given.

    Parameters
    ----------
    loss_or_grads : symbolic expression or list of expressions
        A scalar loss expression, or a list of gradient expressions.
    params : list of shared variables
        The variables to accumulate gradients for.
    average : bool
        True (default): `grads` is the (weighted) mean over the window, so
        that N batches of B examples give the gradient of one batch of N*B
        when the loss is a mean over examples. False: the plain (weighted)
        sum, Caffe's ``iter_size`` semantics.
    weight : symbolic scalar or number, optional
        This batch's weight, typically the number of examples in it (an input
        of the per-batch function). With it the mean is exact for batches of
        different sizes. Default: every batch weighs 1.
    max_norm : float or symbolic scalar, optional
        Clip the accumulated gradients to this total L2 norm, once per window
        (never each batch).
    skip_nonfinite : bool
        If True, a batch whose weighted gradients contain NaN or inf (what
        would enter the buffer) adds nothing and counts nothing; `skipped`
        counts such batches.
    noise_scale : bool
        If True, also keep ``grad_sq`` (one scalar: the weighted sum of each
        micro-batch's squared gradient norm, a skipped batch adding nothing),
        so that :func:`lasagne_accum.gradient_noise` can estimate the gradient
        noise scale from the window. Needs `weight` (the number of examples
        in each micro-batch); works with ``average=False`` too (the estimators
        divide the buffers by the total weight themselves).
    name : str
        Prefix of the counters' names (``accumulate.count``); any other name
        than the default also prefixes the buffers (``W.enc_grad_accu`` with
        ``name="enc"``), so that several accumulations of the same params get
        stable, distinct names.

    Returns
    -------
    Accumulation
        Unpacks as ``(accumulate, reset)``, two OrderedDicts, and carries
        ``.grads``, ``.count``, ``.total``, ``.skipped``, ``.norm``,
        ``.accumulators``, ``.is_step`` and ``.guard()``; the first dictionary
        also carries ``.grads`` and ``.count``.

    Raises
    ------
    TypeError
        If `weight` is not a scalar, `average` or `skip_nonfinite` is not a
        bool, or a parameter is not a float shared variable.
    ValueError
        If `loss_or_grads` is a list of the wrong length, a gradient's shape
        does not match its parameter, a parameter is repeated, the loss does
        not depend on a parameter, a numeric `weight` is not positive, or
        `noise_scale` is given without `weight`.

    Notes
    -----
    Buffers are float32 at least (a float16 model accumulates in float32) and
    otherwise follow each parameter's dtype, so params of mixed dtypes are
    allowed; the total weight uses the widest of them. ``grads`` are cast
    back to each parameter's dtype.

    An apply function built from `grads` is safe on an empty window (an
    end-of-epoch flush right after a full window): `grads` are 0 there, not
    0/0, and the rules of this library guard their updates when given
    ``accu.grads`` (no parameter or rule state changes, no step is counted).
    For a rule of your own, wrap its updates with :meth:`Accumulation.guard`.

    Models with batch normalisation compute their statistics per mini-batch,
    so accumulation is not exactly a large batch for them.

    Examples
    --------
    >>> import numpy as np, pytensor, pytensor.tensor as pt
    >>> from lasagne_accum import accumulate_gradients, sgd
    >>> w = pytensor.shared(0.0, name="w")
    >>> x = pt.vector("x")
    >>> loss = ((w - x) ** 2).mean()          # mean over the batch
    >>> accu, reset = accumulate_gradients(loss, [w], weight=x.shape[0])
    >>> apply = sgd(accu.grads, [w], learning_rate=0.5)
    >>> apply.update(reset)
    >>> step_fn = pytensor.function([x], loss, updates=accu)
    >>> apply_fn = pytensor.function([], [], updates=apply)
    >>> _ = step_fn([1.0, 2.0]); _ = step_fn([6.0])   # batches of 2 and 1
    >>> apply_fn()
    []
    >>> w.get_value()   # the mean of 1, 2, 6 is 3: w - 0.5 * 2 * (w - 3)
    array(3.)
    """
    core = _GradientBuffer(loss_or_grads, params, average=average, weight=weight,
                           max_norm=max_norm, skip_nonfinite=skip_nonfinite, name=name,
                           default_name="accumulate", where="accumulate_gradients",
                           noise_scale=noise_scale)
    count, total = core.count, core.total
    accumulate = AccumulateUpdates()
    for acc, c in zip(core.accumulators, core.contributions):
        accumulate[acc] = acc + c
    accumulate[count] = count + core.increment
    if total is not None:
        accumulate[total] = total + core.added_weight
    if core.grad_sq is not None:
        accumulate[core.grad_sq] = core.grad_sq + core.added_grad_sq
    core.counter_updates(accumulate)

    out_grads, norm = core.gradients(core.accumulators, count if total is None else total)

    # The buffers are zeroed with a select on the (scalar) counter instead of a
    # fresh array of zeros: PyTensor fuses the select into the rule's
    # elementwise step, which writes the zeros in place in the same pass over
    # the buffer (no allocation, no second pass; benchmarks/accumulation.py
    # measures it). A buffer of an empty window is zero already.
    nonempty = pt.gt(count, 0)
    reset_updates = OrderedDict(
        (acc, pt.switch(nonempty, pt.constant(np.zeros((), acc.type.dtype)), acc))
        for acc in core.accumulators
    )
    reset_updates.update(reset([count] + [v for v in (total, core.grad_sq) if v is not None]))
    result = Accumulation(
        accumulate=accumulate, reset=reset_updates, grads=out_grads, norm=norm, count=count,
        total=total if total is not None else count, skipped=core.skipped,
        accumulators=core.accumulators, params=core.params, is_step=nonempty,
        grad_sq=core.grad_sq,
    )
    for g in out_grads:
        g.tag.accumulation = result
    accumulate.accumulation = result
    return result
