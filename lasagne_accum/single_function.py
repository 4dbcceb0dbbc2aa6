"""Single-function gradient accumulation: ``average=N`` and ``with_accumulated_gradients``.

One compiled function is called once per mini-batch. It adds the batch's
gradient into a buffer and, on every N-th call only, applies the update rule
to the mean of the buffered gradients. The rule's own state (velocities,
moments, timesteps) advances only on those stepping calls.

Graph choices (measured in ``benchmarks/single_function.py``):

* The rule's updates, and the gradient buffers' zeros, are selected with one
  ``ifelse(keep, states, new_values)`` (``lazy=True``, default), built as a
  single node (:func:`lasagne_accum._pytensor.lazy_step.window_step`).
  Compiled with :func:`lasagne_accum.mode` (C and Numba), the node runs the
  rule on stepping calls only and writes the new values into the state
  buffers in place, then fills the gradient buffers with zeros, so a
  non-stepping call neither computes nor copies them, and its ``accu + dot``
  is an in-place ``Gemm`` as in the two-function form. Compiled with a plain
  PyTensor mode, or under JAX and PyTorch, it is PyTensor's lazy ``ifelse``.
* The stepping call sets the bool ``<name>.zeroed``; a window's first call
  trusts its buffers to hold zeros only then, and otherwise starts from 0:
  ``accu := select(fresh and not zeroed, 0, accu) + g``. That covers state
  from anywhere else (a checkpoint of ``lazy=False`` or of version 0.2, a
  counter set back to 0 by hand). A select rather than ``0 * accu``, so that
  a NaN left in a buffer is dropped (``0 * NaN`` is NaN); when the gradient
  is a matrix product, :func:`lasagne_accum.mode` moves the select onto
  ``Gemm``'s beta, so the product is still added into the buffer in place.
* ``lazy=False`` selects the rule's values with ``switch`` instead (the rule
  then runs every call), and resets the buffers on each window's first call
  (``zeroed`` stays False).

Buffers, counters, weighting, the non-finite check, the mean and clipping come
from the same private core as :func:`lasagne_accum.accumulate_gradients`
(:class:`lasagne_accum.accumulate._GradientBuffer`), so both forms take the
same options and give the same numbers.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import numpy as np
import pytensor.tensor as pt

from ._checks import check_int, check_params, check_rule_updates
from ._graph import get_or_compute_grads, scalar_state
from ._pytensor.lazy_step import window_step
from .accumulate import _GradientBuffer

if TYPE_CHECKING:
    from ._typing import LossOrGrads, Params, Scalar, UpdateRule, Updates

__all__ = ["with_accumulated_gradients", "SteppingUpdates"]


class SteppingUpdates(OrderedDict):
    """A single-function update dictionary that also tells when it steps.

    Attributes
    ----------
    is_step : symbolic boolean scalar
        True on the calls that take an optimizer step (every `every`-th
        accumulated batch). The new values of everything the rule updates
        carry it too (``value.tag.step_signal``), so that
        :class:`lasagne_accum.ModelAverage` finds it in a copy of this
        dictionary as well.
    count : shared int64 scalar
        Batches accumulated in the current window before this call.
    skipped : shared int64 scalar or None
        With ``skip_nonfinite=True``: batches skipped so far.
    norm : symbolic scalar or None
        With `max_norm`: the accumulated gradient's norm before clipping.
    every : int
    """

    is_step = None
    count = None
    skipped = None
    norm = None
    every = 1


def with_accumulated_gradients(
    loss_or_grads: LossOrGrads,
    params: Params,
    every: int,
    update_rule: UpdateRule,
    *,
    weight: Scalar | None = None,
    average: bool = True,
    max_norm: Scalar | None = None,
    skip_nonfinite: bool = False,
    lazy: bool = True,
    name: str = "average",
    **kwargs: Any,
) -> Updates:
    """Wrap any update rule so that it steps once every `every` calls.

    Per call of the compiled function (``c`` counts the batches accumulated
    in the window):

    * ``accu_i := (accu_i if c > 0 else 0) + weight * gradient_i`` (with
      ``lazy=True`` the stepping call writes the zeros, see the module notes)
    * ``total := (total if c > 0 else 0) + weight``
    * on the `every`-th call: the rule's updates computed from
      ``grads_i = accu_i / total`` (``average=True``) or ``accu_i``
      (``average=False``), clipped to `max_norm`, then ``c := 0``; otherwise
      everything the rule updates keeps its value and ``c := c + 1``.

    Parameters
    ----------
    loss_or_grads : symbolic expression or list of expressions
        A scalar loss expression, or a list of gradient expressions.
    params : list of shared variables
        The variables to update.
    every : int
        Number of batches per optimizer step; a Python integer, since it
        fixes the graph. 1 returns the plain rule.
    update_rule : callable
        ``update_rule(grads, params, **kwargs)`` returning an update
        dictionary that updates every parameter: any rule of
        :mod:`lasagne_accum.updates` or one of your own.
    weight : symbolic scalar or number, optional
        This call's weight in the mean (for example the batch size), so that
        windows of batches of different sizes give the exact mean gradient.
    average : bool
        True (default): the rule gets the (weighted) mean over the window;
        False: the (weighted) sum, as :func:`accumulate_gradients`.
    max_norm : float or symbolic scalar, optional
        Clip the accumulated gradient to this total L2 norm, once per window.
    skip_nonfinite : bool
        If True, a batch whose weighted gradients contain NaN or inf adds
        nothing and does not count towards the `every` batches of the window
        (the window gets longer); ``.skipped`` counts such batches.
    lazy : bool
        True (default): the rule's arithmetic sits behind a lazy ``ifelse``,
        which :func:`lasagne_accum.mode` compiles (C and Numba) to an op that
        runs it on stepping calls only, in place, and zeroes the gradient
        buffers there. False: it is selected
        with ``switch`` and computed every call (simpler graph, more work).
        Both give the same numbers and have the same state, so a checkpoint
        of one resumes in the other.
    name : str
        Prefix of the counters' names (``average.count``, ``average.total``,
        ``average.zeroed``); any other name than the default also prefixes
        the buffers (``W.enc_grad_accu``).
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
        callable or does not return a dict, or an option has the wrong type.
    ValueError
        If `every` < 1, the rule's dictionary does not update every param,
        or `weight` is 0 or negative (the same checks as
        :func:`accumulate_gradients`).

    Notes
    -----
    Compared with the two-function form (:func:`accumulate_gradients`), there
    is no separate apply call: the step happens inside the N-th call. A
    partial window at the end of an epoch stays buffered and is completed by
    the next epoch's first calls. For the same batches both forms give the
    same parameters, option by option.

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
    every = check_int(every, "every")
    if not callable(update_rule):
        raise TypeError(f"update_rule must be callable, got {type(update_rule).__name__}")
    if not isinstance(lazy, (bool, np.bool_)):
        raise TypeError(f"lazy must be True or False, got {lazy!r}")
    if every == 1:
        options = dict(weight=weight, max_norm=max_norm)
        given = [k for k, v in options.items() if v is not None]
        if skip_nonfinite:
            given.append("skip_nonfinite")
        if given:
            raise ValueError(
                f"{', '.join(given)} only applies with every > 1 (it acts on the window's "
                "accumulated gradient); with every=1, use the rule directly"
            )
        params = check_params(params)
        grads = get_or_compute_grads(loss_or_grads, params)
        return check_rule_updates(update_rule, grads, params, kwargs)

    core = _GradientBuffer(loss_or_grads, params, average=average, weight=weight,
                           max_norm=max_norm, skip_nonfinite=skip_nonfinite, name=name,
                           default_name="average", where="with_accumulated_gradients")
    params, count, total = core.params, core.count, core.total
    fresh = pt.eq(count, 0)
    c_new = count + core.increment
    is_step = pt.eq(c_new, every)

    updates = SteppingUpdates()
    updates.is_step, updates.count, updates.every = is_step, count, every
    updates.skipped = core.skipped
    if total is not None:
        zero = np.zeros((), total.type.dtype)
        denominator = pt.switch(fresh, zero, total) + core.added_weight
        updates[total] = denominator
    else:
        denominator = c_new
    # A window's first call starts its buffers from 0. With lazy=True the
    # stepping call writes those zeros (behind the ifelse below, where the
    # two-function form's apply step writes them too) and sets `zeroed`, so
    # that the next call need not reset. Anything else (the lazy=False form, a
    # checkpoint of it or of version 0.2, a counter set back to 0 by hand)
    # leaves `zeroed` False, and the window's first call resets the buffers.
    zeroed = scalar_state(f"{name}.zeroed", "bool", False)
    zeroed.tag.checkpoint_default = False  # load_state: what a 0.2 checkpoint means
    stale = pt.and_(fresh, pt.eq(zeroed, 0)) if lazy else fresh
    sums = []
    for acc, c in zip(core.accumulators, core.contributions):
        acc_new = pt.switch(stale, np.zeros((), acc.type.dtype), acc) + c
        if not lazy:
            updates[acc] = acc_new
        sums.append(acc_new)
    mean_grads, updates.norm = core.gradients(sums, denominator)

    rule_updates = check_rule_updates(update_rule, mean_grads, params, kwargs)
    variables = list(rule_updates.keys())
    new_values = [pt.as_tensor_variable(rule_updates[v]) for v in variables]
    new_values = [
        nv if nv.type.dtype == v.type.dtype else pt.cast(nv, v.type.dtype)
        for nv, v in zip(new_values, variables)
    ]
    if lazy:
        # The unchanged values go first: IfElse hands its first branch through as
        # a view and copies the second, so a non-stepping call copies nothing, and
        # the rule's graph runs on stepping calls only. The buffers ride along: a
        # stepping call also writes their zeros.
        keep = list(variables) + sums
        stepped = new_values + [pt.zeros(a.shape, dtype=a.type.dtype) for a in sums]
        computed = [c_new] + ([denominator] if total is not None else [])
        chosen: Any = window_step(pt.neq(c_new, every), keep, stepped, computed=computed)
        for acc, a in zip(core.accumulators, chosen[len(variables):]):
            updates[acc] = a
    else:
        chosen = [pt.switch(is_step, nv, v) for nv, v in zip(new_values, variables)]
    for v, c in zip(variables, chosen):
        c.tag.step_signal = is_step  # the step signal survives a copy of the dict
        updates[v] = c
    updates[count] = pt.switch(is_step, pt.constant(np.int64(0)), c_new)
    updates[zeroed] = is_step if lazy else pt.constant(np.bool_(False))
    core.counter_updates(updates)
    return updates
