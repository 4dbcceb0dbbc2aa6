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
concatenated batch.
"""

from collections import OrderedDict

import numpy as np
import pytensor.tensor as pt
from pytensor.compile.sharedvalue import SharedVariable

from .constraints import total_norm_constraint
from .grads import (
    accumulator_dtype,
    check_params,
    get_or_compute_grads,
    hyperparameter,
    param_label,
    scalar_state,
    state_like,
)

__all__ = ["accumulate_gradients", "reset", "Accumulation", "AccumulateUpdates"]


def reset(variables):
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
    out = OrderedDict()
    for i, var in enumerate(variables):
        if not isinstance(var, SharedVariable):
            raise TypeError(
                f"reset(): variables[{i}] ({param_label(var, i)}) is not a shared variable"
            )
        out[var] = pt.zeros_like(var)
    return out


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
    """

    accumulation = None

    @property
    def grads(self):
        return self.accumulation.grads

    @property
    def count(self):
        return self.accumulation.count


class Accumulation(tuple):
    """The result of :func:`accumulate_gradients`: ``(accumulate, reset)``.

    Unpacks as a 2-tuple of OrderedDicts, as in Lasagne's design discussion,
    and carries what the apply function needs.

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
        weighted sum. Clipped to `max_norm` when given.
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
    params : list of shared variables
    """

    def __new__(cls, accumulate, reset_updates, **attrs):
        self = super().__new__(cls, (accumulate, reset_updates))
        self.__dict__.update(attrs)
        accumulate.accumulation = self
        return self

    @property
    def accumulate(self):
        return self[0]

    @property
    def reset(self):
        return self[1]

    def guard(self, updates):
        """Make `updates` a no-op when nothing has been accumulated.

        Every update ``v: new`` becomes ``v: switch(count > 0, new, v)``: an
        apply function built from the result changes nothing (no step counted,
        no NaN from dividing by a zero total) when called on an empty window,
        for example by an end-of-epoch flush right after a full window.

        Parameters
        ----------
        updates : dict
            The apply dictionary (the rule's updates, usually with `reset`
            merged in).

        Returns
        -------
        OrderedDict
        """
        nonempty = pt.gt(self.count, 0)
        return OrderedDict((var, pt.switch(nonempty, new, var)) for var, new in updates.items())


def accumulate_gradients(loss_or_grads, params, *, average=True, weight=None,
                         max_norm=None, skip_nonfinite=False, name="accumulate"):
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
        If True, a batch whose gradients contain NaN or inf adds nothing and
        counts nothing; `skipped` counts such batches.
    name : str
        Prefix of the counters' names (``accumulate.count``), to keep them
        apart in checkpoints when a model uses several accumulations.

    Returns
    -------
    Accumulation
        A 2-tuple ``(accumulate, reset)`` of OrderedDicts carrying ``.grads``,
        ``.count``, ``.total``, ``.skipped``, ``.norm``, ``.accumulators`` and
        ``.guard()``; the first dictionary also carries ``.grads`` and
        ``.count``.

    Raises
    ------
    TypeError
        If `weight` is not a scalar, or a parameter is not a float shared
        variable.
    ValueError
        If `loss_or_grads` is a list of the wrong length, a gradient's shape
        does not match its parameter, a parameter is repeated, or a numeric
        `weight` is not positive.

    Notes
    -----
    Buffers are float32 at least (a float16 model accumulates in float32) and
    otherwise follow each parameter's dtype, so params of mixed dtypes are
    allowed; the total weight uses the widest of them. ``grads`` are cast
    back to each parameter's dtype.

    Calling an apply function built from `grads` with nothing accumulated
    divides 0 by 0; wrap its updates with :meth:`Accumulation.guard` (the
    :func:`lasagne_accum.training.compile_accumulation` helper does) to make
    it a no-op instead.

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
    params = check_params(params)
    grads = get_or_compute_grads(loss_or_grads, params)
    if not params:
        raise ValueError("accumulate_gradients() needs at least one parameter")
    if not isinstance(average, (bool, np.bool_)):
        raise TypeError(f"average must be True or False, got {average!r}")
    acc_dtypes = [accumulator_dtype(p.type.dtype) for p in params]
    total_dtype = np.result_type(*acc_dtypes).name

    if weight is None:
        w = None
    else:
        w = hyperparameter(weight, "weight", total_dtype, low=0)
        if w.owner is None and hasattr(w, "data") and float(w.data) == 0:
            raise ValueError("weight must be positive, got 0")

    accumulators = [state_like(p, "grad_accu", i, dtype=d)
                    for i, (p, d) in enumerate(zip(params, acc_dtypes))]
    count = scalar_state(f"{name}.count", "int64")
    total = scalar_state(f"{name}.total", total_dtype) if w is not None else None

    contributions = []
    for g, acc in zip(grads, accumulators):
        g = g if g.type.dtype == acc.type.dtype else pt.cast(g, acc.type.dtype)
        contributions.append(g if w is None else pt.cast(w, acc.type.dtype) * g)

    skipped = None
    if skip_nonfinite:
        finite = pt.all([pt.all(pt.isfinite(g)) for g in grads])
        contributions = [pt.switch(finite, c, pt.zeros_like(c)) for c in contributions]
        skipped = scalar_state(f"{name}.skipped", "int64")
        increment = pt.cast(finite, "int64")
    else:
        increment = pt.constant(np.int64(1))

    accumulate = AccumulateUpdates()
    for acc, c in zip(accumulators, contributions):
        accumulate[acc] = acc + c
    accumulate[count] = count + increment
    if total is not None:
        accumulate[total] = total + (w if not skip_nonfinite else pt.switch(finite, w, 0))
    if skipped is not None:
        accumulate[skipped] = skipped + (1 - increment)

    if average:
        denom = pt.cast(count, total_dtype) if total is None else total
        mean = [acc / pt.cast(denom, acc.type.dtype) for acc in accumulators]
    else:
        mean = list(accumulators)
    out_grads = [m if m.type.dtype == p.type.dtype else pt.cast(m, p.type.dtype)
                 for m, p in zip(mean, params)]
    norm = None
    if max_norm is not None:
        out_grads, norm = total_norm_constraint(out_grads, max_norm, return_norm=True)

    # The buffers are zeroed with a select on the (scalar) counter instead of a
    # fresh array of zeros: PyTensor fuses the select into the rule's
    # elementwise step, which writes the zeros in place in the same pass over
    # the buffer (30% off Adam's apply step, no allocation; see
    # benchmarks/accumulation.py). A buffer of an empty window is zero already.
    nonempty = pt.gt(count, 0)
    reset_updates = OrderedDict(
        (acc, pt.switch(nonempty, pt.constant(np.zeros((), acc.type.dtype)), acc))
        for acc in accumulators
    )
    reset_updates.update(reset([count] + ([total] if total is not None else [])))
    return Accumulation(
        accumulate, reset_updates,
        grads=out_grads, norm=norm, count=count, total=total if total is not None else count,
        skipped=skipped, accumulators=accumulators, params=params,
    )
