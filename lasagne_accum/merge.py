"""Assemble one function's updates from several dictionaries: :func:`merge_updates`."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from typing import TYPE_CHECKING

from pytensor.compile.sharedvalue import SharedVariable

from ._checks import param_label

if TYPE_CHECKING:
    from ._typing import Updates, UpdatesLike

__all__ = ["merge_updates"]


def merge_updates(*dicts: UpdatesLike | None) -> Updates:
    """Merge update dictionaries in order, refusing a variable given two different values.

    The apply step of the two-function form is the rule's updates, the
    accumulation's reset and, often, a model average's updates: merge them
    here instead of ``apply.update(...)`` by hand, so that a variable two of
    them update is caught at build time, not as a silently lost update.

    Parameters
    ----------
    *dicts : dict or None
        Update dictionaries (``{shared variable: new value}``); None is
        skipped.

    Returns
    -------
    OrderedDict
        Every entry, in the order given.

    Raises
    ------
    TypeError
        If an argument is not a dict, or a key is not a shared variable.
    ValueError
        If a variable is given two different new values (the same expression
        twice is accepted); the message names the variable.

    Examples
    --------
    >>> import numpy as np, pytensor, pytensor.tensor as pt
    >>> import lasagne_accum as la
    >>> w = pytensor.shared(np.zeros(2), name="w")
    >>> x = pt.vector("x")
    >>> accu, reset = la.accumulate_gradients(((w - x) ** 2).sum(), [w])
    >>> apply = la.merge_updates(la.sgd(accu.grads, [w], 0.1), reset)
    >>> [v.name for v in apply]
    ['w', 'w.grad_accu', 'accumulate.count']
    >>> la.merge_updates({w: w + 1}, {w: w - 1})
    Traceback (most recent call last):
    ...
    ValueError: merge_updates(): w is updated twice, with different values (dicts 0 and 1); ...
    """
    out: Updates = OrderedDict()
    origin: dict[SharedVariable, int] = {}
    for k, updates in enumerate(dicts):
        if updates is None:
            continue
        if not isinstance(updates, Mapping):
            raise TypeError(f"merge_updates(): argument {k} is a {type(updates).__name__}, "
                            "not an update dictionary")
        for var, new in updates.items():
            if not isinstance(var, SharedVariable):
                raise TypeError(f"merge_updates(): argument {k} has a key {var!r} that is not "
                                "a shared variable")
            if var in out and out[var] is not new:
                raise ValueError(
                    f"merge_updates(): {param_label(var)} is updated twice, with different "
                    f"values (dicts {origin[var]} and {k}); a function can give a shared "
                    "variable one new value: leave it out of one of them")
            out[var] = new
            origin.setdefault(var, k)
    return out
