"""Single-function gradient accumulation: ``average=N`` and ``with_accumulated_gradients``.

One compiled function is called once per mini-batch. It adds the batch's
gradient into a buffer and, on every N-th call only, applies the update rule
to the mean of the buffered gradients. The rule's own state (velocities,
moments, timesteps) advances only on those stepping calls.

Graph choices (measured in ``benchmarks/single_function.py``):

* The buffer is reset *lazily*: instead of writing zeros after a step, the
  first call of a window computes ``accu := 0 * accu + g``, a scaled
  accumulation that PyTensor fuses into the gradient's matrix product
  (``Gemm`` with ``beta = 0`` or ``1``, in place). A non-stepping call therefore
  costs what the two-function form's accumulate step costs.
* The rule's updates sit behind one lazy ``ifelse`` (``lazy=True``, default),
  so that the rule's arithmetic runs on stepping calls only; ``lazy=False``
  selects with ``switch`` instead (the rule then runs every call).
"""

from collections import OrderedDict
from collections.abc import Mapping

import numpy as np
import pytensor.tensor as pt
from pytensor.compile.sharedvalue import SharedVariable
from pytensor.ifelse import ifelse

from .grads import (
    accumulator_dtype,
    check_every,
    check_params,
    get_or_compute_grads,
    hyperparameter,
    param_label,
    scalar_state,
    state_like,
)

__all__ = ["with_accumulated_gradients", "SteppingUpdates"]


class SteppingUpdates(OrderedDict):
    """A single-function update dictionary that also tells when it steps.

    Attributes
    ----------
    is_step : symbolic boolean scalar
        True on the calls that take an optimizer step (every `every`-th).
        :class:`lasagne_accum.ModelAverage` uses it to average only steps.
    count : shared int64 scalar
        Calls accumulated in the current window before this call.
    every : int
    """

    is_step = None
    count = None
    every = 1


def with_accumulated_gradients(loss_or_grads, params, every, update_rule, *, weight=None,
                               lazy=True, name="average", **kwargs):
    """Wrap any update rule so that it steps once every `every` calls.

    Per call of the compiled function (``c`` counts calls in the window):

    * ``accu_i := (accu_i if c > 0 else 0) + weight * gradient_i``
    * ``total := (total if c > 0 else 0) + weight``
    * on the `every`-th call: the rule's updates computed from
      ``grads_i = accu_i / total``, then ``c := 0``; otherwise everything the
      rule updates keeps its value and ``c := c + 1``.

    Parameters
    ----------
    loss_or_grads : symbolic expression or list of expressions
        A scalar loss expression, or a list of gradient expressions.
    params : list of shared variables
        The variables to update.
    every : int
        Number of calls (mini-batches) per optimizer step; a Python integer,
        since it fixes the graph. 1 returns the plain rule.
    update_rule : callable
        ``update_rule(grads, params, **kwargs)`` returning an update
        dictionary that updates every parameter: any rule of
        :mod:`lasagne_accum.updates` or one of your own.
    weight : symbolic scalar, optional
        This call's weight in the mean (for example the batch size), so that
        windows of batches of different sizes give the exact mean gradient.
    lazy : bool
        True (default): the rule's arithmetic sits behind a lazy ``ifelse``
        and runs on stepping calls only. False: it is selected with
        ``switch`` and computed every call (simpler graph, more work).
    name : str
        Prefix of the counters' names (``average.count``).
    **kwargs
        Hyperparameters passed on to `update_rule`.

    Returns
    -------
    SteppingUpdates
        One dictionary (an OrderedDict) for one function called once per
        mini-batch; its ``.is_step`` is the symbolic condition of the stepping
        calls.

    Raises
    ------
    TypeError
        If `every` is not an integer (or is symbolic), `update_rule` is not
        callable or does not return a dict.
    ValueError
        If `every` < 1, or the rule's dictionary does not update every param.

    Notes
    -----
    Compared with the two-function form (:func:`accumulate_gradients`), there
    is no separate apply call: the step happens inside the N-th call. A
    partial window at the end of an epoch stays buffered and is completed by
    the next epoch's first calls.

    Examples
    --------
    >>> import numpy as np, pytensor, pytensor.tensor as pt
    >>> from lasagne_accum import with_accumulated_gradients, sgd
    >>> w = pytensor.shared(np.zeros(1), name="w")
    >>> x = pt.scalar("x")
    >>> upd = with_accumulated_gradients(((w - x) ** 2).sum(), [w], 2, sgd, learning_rate=0.5)
    >>> f = pytensor.function([x], [], updates=upd)
    >>> _ = f(1.0); w.get_value()     # buffered, no step yet
    array([0.])
    >>> _ = f(3.0); w.get_value()     # mean gradient of the two calls: -4
    array([2.])
    """
    every = check_every(every, "every")
    if not callable(update_rule):
        raise TypeError(f"update_rule must be callable, got {type(update_rule).__name__}")
    params = check_params(params)
    grads = get_or_compute_grads(loss_or_grads, params)
    if every == 1:
        if weight is not None:
            raise ValueError("weight only applies with every > 1")
        return _checked_rule_updates(update_rule, grads, params, kwargs)

    acc_dtypes = [accumulator_dtype(p.type.dtype) for p in params]
    total_dtype = np.result_type(*acc_dtypes).name if params else "float64"
    count = scalar_state(f"{name}.count", "int64")
    fresh = pt.eq(count, 0)
    keep = pt.cast(pt.neq(count, 0), total_dtype)
    c_new = count + 1
    is_step = pt.eq(c_new, every)

    updates = SteppingUpdates()
    updates.is_step, updates.count, updates.every = is_step, count, every
    mean_grads = []
    if weight is None:
        denom = pt.cast(c_new, total_dtype)
    else:
        w = hyperparameter(weight, "weight", total_dtype, low=0)
        total = scalar_state(f"{name}.total", total_dtype)
        denom = pt.switch(fresh, w, total + w)
        updates[total] = denom
    for i, (p, g, dtype) in enumerate(zip(params, grads, acc_dtypes)):
        acc = state_like(p, "grad_accu", i, dtype=dtype)
        g = g if g.type.dtype == dtype else pt.cast(g, dtype)
        if weight is not None:
            g = pt.cast(w, dtype) * g
        acc_new = pt.cast(keep, dtype) * acc + g
        updates[acc] = acc_new
        mean = acc_new / pt.cast(denom, dtype)
        mean_grads.append(mean if dtype == p.type.dtype else pt.cast(mean, p.type.dtype))

    rule_updates = _checked_rule_updates(update_rule, mean_grads, params, kwargs)
    variables = list(rule_updates.keys())
    new_values = [pt.as_tensor_variable(rule_updates[v]) for v in variables]
    new_values = [
        nv if nv.type.dtype == v.type.dtype else pt.cast(nv, v.type.dtype)
        for nv, v in zip(new_values, variables)
    ]
    if lazy:
        # IfElse hands its first branch through as a view and copies the
        # second: the unchanged values go first, so a non-stepping call
        # copies nothing, and the rule's graph runs on stepping calls only.
        chosen = ifelse(pt.neq(c_new, every), list(variables), new_values)
        if not isinstance(chosen, (list, tuple)):
            chosen = [chosen]
    else:
        chosen = [pt.switch(is_step, nv, v) for nv, v in zip(new_values, variables)]
    for v, c in zip(variables, chosen):
        updates[v] = c
    updates[count] = pt.switch(is_step, pt.constant(np.int64(0)), c_new)
    return updates


def _checked_rule_updates(update_rule, grads, params, kwargs):
    rule_name = getattr(update_rule, "__name__", None) or getattr(
        getattr(update_rule, "func", None), "__name__", repr(update_rule)
    )
    result = update_rule(grads, params, **kwargs)
    if not isinstance(result, Mapping):
        raise TypeError(
            f"update_rule {rule_name} returned {type(result).__name__}, not an update "
            "dictionary; it must return a dict mapping shared variables to new values"
        )
    for i, p in enumerate(params):
        if p not in result:
            raise ValueError(
                f"update_rule {rule_name} does not update params[{i}] "
                f"({param_label(p, i)}); its dictionary must update every parameter"
            )
    for var in result:
        if not isinstance(var, SharedVariable):
            raise TypeError(
                f"update_rule {rule_name} returned a key {var!r} that is not a shared variable"
            )
    return OrderedDict(result)
