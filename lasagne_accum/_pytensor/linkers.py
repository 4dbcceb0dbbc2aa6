"""Our JAX and PyTorch linkers: PyTensor's, with fixes to how some ops are converted.

Each fix is written up, with a reproducer on plain PyTensor, in the docs'
backends page (and checked there by ``tests/test_upstream.py``, which says
when PyTensor has fixed it upstream):

* JAX: a reduction (``CAReduce``: ``Sum``, ``Prod``...) returns its
  *accumulator* dtype, so the bias gradient of a float32 model comes back
  float64 and, through the update, turns float32 shared variables into
  float64 ones; ``Alloc`` of a 0-d constant (which PyTensor hands JAX as a
  Python number) and ``DeepCopyOp`` of one come back float64 too. Fixed by
  casting their result to the output's dtype.
* PyTorch: the scalar ``Pow`` and ``Mod`` map to ``torch.power`` and
  ``torch.mod``, which do not exist (``torch.pow``, ``torch.remainder``);
  ``EQ`` maps to ``torch.equal``, which compares whole tensors to one Python
  bool (the elementwise function is ``torch.eq``).

The linkers swap the op of each such node, in the function's own graph just
before conversion, for :class:`Fixed`, whose conversion (registered for
that class alone) calls PyTensor's own and applies the fix. Ops inside inner
graphs (``Scan``, ``OpFromGraph``) are converted by PyTensor alone.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
from pytensor.graph.basic import Apply
from pytensor.graph.op import Op
from pytensor.link.jax.linker import JAXLinker as _PyTensorJAXLinker
from pytensor.link.pytorch.linker import PytorchLinker as _PyTensorPytorchLinker

__all__ = ["Fixed", "JAXLinker", "PytorchLinker"]

_registered: set[str] = set()


class Fixed(Op):
    """An op that our linker converts with a fix (see the module notes).

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


# ------------------------------------------------------------------------------- JAX
def _jax_in_output_dtype(op, node=None, **kwargs):
    """PyTensor's JAX function for `op`, its result cast to the output's dtype."""
    from pytensor.link.jax.dispatch import jax_funcify

    inner = jax_funcify(op, node=node, **kwargs)
    dtype = node.outputs[0].type.dtype

    def in_output_dtype(*inputs):
        return inner(*inputs).astype(dtype)

    return in_output_dtype


def _jax_arange(op, node=None, **kwargs):
    """``jax.numpy.arange`` with the constant bounds as Python ints (see the module notes)."""
    import jax.numpy as jnp
    from pytensor.graph.basic import Constant
    from pytensor.link.jax.dispatch import jax_funcify
    from pytensor.tensor.shape import Shape_i

    constants = []
    for arg in node.inputs:
        if isinstance(arg, Constant):
            constants.append(np.asarray(arg.data).item())
        elif arg.owner is not None and isinstance(arg.owner.op, Shape_i):
            constants.append(None)   # a static shape under jit
        else:
            return jax_funcify(op, node=node, **kwargs)   # PyTensor's, with its error
    dtype = op.dtype

    def arange(start, stop, step):
        bounds = [v if c is None else c for v, c in zip((start, stop, step), constants)]
        return jnp.arange(*bounds, dtype=dtype)

    return arange


def _jax_fix_for(node):
    from pytensor.compile.ops import DeepCopyOp
    from pytensor.tensor.basic import Alloc, ARange
    from pytensor.tensor.elemwise import CAReduce

    if isinstance(node.op, ARange):
        return _jax_arange
    if not isinstance(node.op, (CAReduce, Alloc, DeepCopyOp)):
        return None
    if getattr(node.outputs[0].type, "dtype", None) is None:  # not a tensor (a generator)
        return None
    return _jax_in_output_dtype


def _register_jax():
    if "jax" in _registered:
        return
    from pytensor.link.jax.dispatch import jax_funcify

    @jax_funcify.register(Fixed)
    def jax_funcify_Fixed(op, node=None, **kwargs):
        return op.fix(op.op, node=node, **kwargs)

    _registered.add("jax")


class JAXLinker(_PyTensorJAXLinker):
    """PyTensor's JAX linker with our fixes (see the module notes)."""

    def fgraph_convert(self, fgraph, *args, **kwargs):
        _register_jax()
        _swap(fgraph, _jax_fix_for)
        return super().fgraph_convert(fgraph, *args, **kwargs)


# --------------------------------------------------------------------------- PyTorch
def _torch_elementwise(name):
    def fix(op, node=None, **kwargs):
        import torch

        return getattr(torch, name)

    fix.__name__ = f"torch_{name}"
    return fix


_TORCH_SCALAR = {"Pow": _torch_elementwise("pow"), "Mod": _torch_elementwise("remainder"),
                 "EQ": _torch_elementwise("eq")}


def _torch_fix_for(node):
    from pytensor.scalar.basic import EQ, Mod, Pow
    from pytensor.tensor.elemwise import Elemwise

    op = node.op
    if isinstance(op, Elemwise) and type(op.scalar_op) in (Pow, Mod, EQ):
        return _TORCH_SCALAR[type(op.scalar_op).__name__]
    return None


def _register_pytorch():
    if "pytorch" in _registered:
        return
    from pytensor.link.pytorch.dispatch import pytorch_funcify

    @pytorch_funcify.register(Fixed)
    def pytorch_funcify_Fixed(op, node=None, **kwargs):
        return op.fix(op.op, node=node, **kwargs)

    _registered.add("pytorch")


class PytorchLinker(_PyTensorPytorchLinker):
    """PyTensor's PyTorch linker with our fixes (see the module notes)."""

    def fgraph_convert(self, fgraph, *args, **kwargs):
        _register_pytorch()
        _swap(fgraph, _torch_fix_for)
        return super().fgraph_convert(fgraph, *args, **kwargs)
