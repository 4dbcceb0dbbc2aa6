"""Exact float32 constants in the C backend's generated code.

PyTensor writes a scalar constant of a fused elementwise loop (``Composite``)
into the C code as ``str(value)``: a float32 ``0.999`` becomes the *double*
literal ``0.999``, which is not the float32 value 0.99900001287... The C code
then computes ``1 - beta2`` and friends with a slightly different number than
Numba, JAX, PyTorch and numpy do (5e-6 relative after three Adam steps in
float32). :func:`exact_literals` rebuilds each such ``Composite`` with the
constant written as a float64 constant holding the float32's exact value,
cast to float32 (``(npy_float32)(0.9990000128746033)``, which the C compiler
folds): the loop computes with the float32 value, at no cost per element.
Constants whose shortest text is already exact (``0.5``) are left alone.

The reproducer on plain PyTensor, which says when PyTensor has fixed it:
``tests/test_upstream_c.py::test_c_writes_float32_constants_as_inexact_double_literals``.
"""

from __future__ import annotations

import numpy as np

__all__ = ["exact_literals", "inexact_literal"]


def inexact_literal(dtype: str, value) -> bool:
    """Whether PyTensor's C literal of this float16/float32 value reads back as another number.

    Examples
    --------
    >>> inexact_literal("float32", np.float32(0.999)), inexact_literal("float32", np.float32(0.5))
    (True, False)
    """
    if dtype not in ("float16", "float32") or not np.isfinite(value):
        return False
    return float(str(value)) != float(value)


def _exact(composite):
    """`composite` with its inexact float constants made exact, or None if it has none.

    The new inner graph is built node by node with fresh variables: the inner
    graph of a ``Composite`` is frozen, and its variables are shared with every
    other ``Composite`` of the same structure, so it must not be cloned and
    rewired in place.
    """
    from pytensor.graph.basic import Constant
    from pytensor.scalar.basic import Composite, ScalarConstant, float64
    from pytensor.scalar.basic import cast as scalar_cast

    fg = composite.fgraph
    memo = {}
    for node in fg.toposort():
        for var in node.inputs:
            if (var not in memo and var.owner is None and isinstance(var, Constant)
                    and inexact_literal(var.type.dtype, var.data)):
                memo[var] = scalar_cast(ScalarConstant(float64, np.float64(var.data)),
                                        var.type.dtype)
    if not memo:
        return None
    inputs = [i.type() for i in fg.inputs]
    memo.update(zip(fg.inputs, inputs))
    for node in fg.toposort():
        new = node.op.make_node(*[memo.get(v, v) for v in node.inputs])
        memo.update(zip(node.outputs, new.outputs))
    return Composite(inputs, [memo[o] for o in fg.outputs], name=composite.name)


def exact_literals():
    """The rewrite: every fused loop's float32/float16 constants written exactly."""
    from pytensor.graph.rewriting.basic import dfs_rewriter, node_rewriter
    from pytensor.scalar.basic import Composite
    from pytensor.tensor.elemwise import Elemwise

    @node_rewriter([Elemwise])
    def local_exact_float_literals(fgraph, node):
        op = node.op
        if not isinstance(op.scalar_op, Composite):
            return None
        exact = _exact(op.scalar_op)
        if exact is None:
            return None
        new = Elemwise(exact, inplace_pattern=op.inplace_pattern).make_node(*node.inputs)
        return new.outputs

    return dfs_rewriter(local_exact_float_literals)
