"""Names that moved between the PyTensor releases in :data:`lasagne_accum._pytensor.SUPPORTED`.

Each is looked up where the installed release keeps it, newest place first,
so that no deprecated import runs on a release that has the new one.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ifelse", "IfElse", "LazyIfElse", "mutable_graph"]

try:  # PyTensor 3.3 and later (LazyIfElse: an ifelse whose branches are inner graphs)
    from pytensor.conditional.op import IfElse, ifelse
    from pytensor.conditional.op import LazyIfElse as _LazyIfElse
except ImportError:  # PyTensor 3.0
    from pytensor.ifelse import IfElse, ifelse
    _LazyIfElse = None

#: PyTensor's ``LazyIfElse`` op class, or None on a release without it.
LazyIfElse: Any = _LazyIfElse


def mutable_graph(fgraph: Any) -> Any:
    """A ``FunctionGraph`` of `fgraph` that rewrites may read and rebuild.

    PyTensor 3.3 keeps an ``OpFromGraph``'s inner graph frozen (interned nodes
    that cannot be cloned); earlier releases keep a plain ``FunctionGraph``,
    which is cloned here so the op's own graph is never touched.
    """
    unfreeze = getattr(fgraph, "unfreeze", None)
    return unfreeze() if unfreeze is not None else fgraph.clone()
