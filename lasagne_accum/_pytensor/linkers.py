"""What our JAX, PyTorch and host linkers share: the op of a fixed node, and state.

One module per backend, each beside the test file of its reproducers: the
upstream PyTensor bugs it works around, each run on plain PyTensor (and
written up in the docs' backends page); a test there fails, naming our fix,
when PyTensor has fixed its bug upstream.

* :mod:`.jax_linker` (``tests/test_upstream_jax.py``): the JAX linker, with
  fixes to how some ops are converted, donating the buffers of updated state.
* :mod:`.pytorch_linker` (``tests/test_upstream_pytorch.py``): the PyTorch
  linker, with fixes to how some ops are converted, keeping state on a device.
* :mod:`.host_linker` (``tests/test_upstream_c.py``): the C, Numba and
  Python linkers, reading a JAX array or torch tensor left by another mode.

The JAX and PyTorch linkers swap the op of each node they fix, in the
function's own graph just before conversion, for :class:`Fixed`, whose
conversion (registered for that class alone) calls PyTensor's own and applies
the fix. Ops inside inner graphs (``Scan``, ``OpFromGraph``) are converted by
PyTensor alone.
"""

from __future__ import annotations

from typing import Any, Callable

from pytensor.graph.basic import Apply
from pytensor.graph.op import Op

__all__ = ["Fixed"]

#: The backends whose conversion of :class:`Fixed` is registered ("jax", "pytorch").
_registered: set[str] = set()


class Fixed(Op):
    """An op that our linker converts with a fix (see the backend modules' notes).

    Parameters
    ----------
    op : Op
        The op of the node.
    fix : callable
        ``fix(op, node, **kwargs)``: the backend function for the node.
    """

    __props__ = ("op", "fix")

    def __init__(self, op: Op, fix: Callable[..., Any]):
        self.op, self.fix = op, fix
        self.view_map = dict(getattr(op, "view_map", {}))
        self.destroy_map = dict(getattr(op, "destroy_map", {}))

    def __str__(self):
        return str(self.op)

    def make_node(self, *inputs):
        node = self.op.make_node(*inputs)
        return Apply(self, node.inputs, node.outputs)

    def perform(self, node, inputs, output_storage):
        self.op.perform(node, inputs, output_storage)


def _swap(fgraph, fix_for: Callable[[Apply], Any]) -> None:
    for node in fgraph.apply_nodes:
        if isinstance(node.op, Fixed):
            continue
        fix = fix_for(node)
        if fix is not None:
            node.op = Fixed(node.op, fix)


def _updated_inputs(fgraph, storage_map) -> list[int]:
    """Indices of the fgraph inputs that the function updates (shared variables).

    Raises
    ------
    ValueError
        If two updated inputs share one value (a shared variable and its
        ``clone()``): two outputs would be written to one buffer, and donating
        it twice is an error in JAX and writing it twice a silent race in place.
    """
    from pytensor.tensor.type import TensorType

    mapping = getattr(fgraph, "update_mapping", None) or {}
    updated = sorted({i for i in mapping.values()
                      if isinstance(fgraph.inputs[i].type, TensorType)})
    cells: dict[int, int] = {}
    for i in updated:
        cell = storage_map.get(fgraph.inputs[i]) if storage_map is not None else None
        if cell is None:
            continue
        if id(cell) in cells:
            name, other = _label(fgraph.inputs[i]), _label(fgraph.inputs[cells[id(cell)]])
            pair = (f"{name} and a clone() of it share one value" if name == other else
                    f"{other} and {name} share one value (one is a clone() of the other)")
            raise ValueError(
                f"{name} is updated twice in one function: {pair}, so two updated outputs "
                "would alias one buffer; update only one of them")
        cells[id(cell)] = i
    return updated


def _label(variable) -> str:
    return variable.name or str(variable)


def _output_cells(fgraph, storage_map) -> list[list]:
    """The storage cells of computed outputs (not the cells of inputs passed through)."""
    if storage_map is None:
        return []
    inputs = {id(storage_map.get(i)) for i in fgraph.inputs}
    cells = []
    for out in fgraph.outputs:
        cell = storage_map.get(out)
        if out.owner is not None and cell is not None and id(cell) not in inputs:
            cells.append(cell)
    return cells
