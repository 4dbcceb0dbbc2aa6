"""The sum of squares of an array in float64, as one vectorized loop.

The gradient noise scale needs ``|g|^2`` of whole buffers (the window's mean
gradient at every apply, small gradients at every accumulate step):
``sum(sqr(float64(x)))``. PyTensor reduces that element by element in a loop
whose float64 accumulator neither compiler may split (the sum would change
order), a few times slower than a BLAS dot of the same array. :class:`SumSquares`
computes it with eight float64 partial sums (C) or with reassociation allowed
(Numba): both vectorize, and the result differs from the sequential sum only
in float64 rounding. NaN and infinity propagate as in the plain sum.

:func:`sum_squares`, in the C and Numba modes of :func:`lasagne_accum.mode`,
replaces the sums that :func:`lasagne_accum._graph.sum_of_squares` builds
(and only those: they carry a tag) before PyTensor rewrites the graph; in
other modes they stay PyTensor's own reduction.
"""

from __future__ import annotations

import numpy as np
from pytensor.graph.basic import Apply
from pytensor.link.c.op import COp

from . import source_key

__all__ = ["SumSquares", "TAG", "sum_squares", "register_numba"]

#: The tag attribute :func:`lasagne_accum._graph.sum_of_squares` sets on its output.
TAG = "lasagne_accum_sum_of_squares"

_registered: set[str] = set()


class SumSquares(COp):
    """The sum, in float64, of the squares of every element of a float32 or float64 array.

    `square` is the dtype each square is computed in: ``"float64"`` (the
    element converted first: ``sum(sqr(float64(x)))``) or, for a float32
    array, ``"float32"`` (``sum(sqr(x))`` with a float64 accumulator, as
    PyTensor sums float32).
    """

    __props__ = ("square",)

    def __init__(self, square="float64"):
        if square not in ("float32", "float64"):
            raise ValueError(f"square must be float32 or float64, got {square!r}")
        self.square = square

    def make_node(self, x):
        import pytensor.tensor as pt

        x = pt.as_tensor_variable(x)
        if x.type.dtype not in ("float32", "float64") or (
                self.square == "float32" and x.type.dtype != "float32"):
            raise TypeError(f"SumSquares(square={self.square!r}) takes "
                            f"{'float32' if self.square == 'float32' else 'float32 or float64'}"
                            f", got {x.type.dtype}")
        return Apply(self, [x], [pt.scalar(dtype="float64")])

    def perform(self, node, inputs, outputs):
        squares = np.square(inputs[0], dtype=self.square)
        outputs[0][0] = np.asarray(np.sum(squares, dtype=np.float64))

    def infer_shape(self, *args):   # (fgraph, node, shapes); PyTensor 3.3: (node, shapes)
        return [()]

    def c_code_cache_version(self):
        return (2, source_key(__file__))

    def c_code(self, node, name, inputs, outputs, sub):
        (x,), (z,) = inputs, outputs
        fail = sub["fail"]
        ctype = {"float32": "npy_float32", "float64": "npy_float64"}[node.inputs[0].type.dtype]
        # each square in the op's dtype, then added in float64
        sq = "double" if self.square == "float64" else "npy_float32"
        terms = "\n".join(f"{{ const {sq} v = ({sq})p[i + {j}]; s{j} += (double)(v * v); }}"
                           for j in range(8))
        return f"""
        {{
            PyArrayObject* contiguous = PyArray_GETCONTIGUOUS({x});
            if (contiguous == NULL) {{ {fail} }}
            const {ctype}* p = (const {ctype}*)PyArray_DATA(contiguous);
            const npy_intp n = PyArray_SIZE(contiguous);
            double s0 = 0, s1 = 0, s2 = 0, s3 = 0, s4 = 0, s5 = 0, s6 = 0, s7 = 0;
            npy_intp i = 0;
            for (; i + 8 <= n; i += 8) {{
                {terms}
            }}
            for (; i < n; ++i) {{ const {sq} v = ({sq})p[i]; s0 += (double)(v * v); }}
            Py_DECREF(contiguous);
            if ({z} == NULL || PyArray_NDIM({z}) != 0 || PyArray_TYPE({z}) != NPY_FLOAT64) {{
                Py_XDECREF({z});
                {z} = (PyArrayObject*)PyArray_ZEROS(0, NULL, NPY_FLOAT64, 0);
                if ({z} == NULL) {{ {fail} }}
            }}
            *(npy_float64*)PyArray_DATA({z}) = ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7));
        }}
        """


def _squared_input(node):
    """``(x, square dtype)`` of a tagged float64-accumulated ``sum(sqr(x))`` (`x` possibly
    ``float64(y)`` of a float32 `y`: then ``(y, "float64")``), or None."""
    from pytensor.scalar.basic import Cast, Sqr
    from pytensor.tensor.elemwise import Elemwise
    from pytensor.tensor.math import Sum

    if not getattr(node.outputs[0].tag, TAG, False) or not isinstance(node.op, Sum):
        return None
    if node.op.acc_dtype != "float64" or (
            node.op.axis is not None
            and set(node.op.axis) != set(range(node.inputs[0].type.ndim))):
        return None
    sq = node.inputs[0].owner
    if sq is None or not (isinstance(sq.op, Elemwise) and isinstance(sq.op.scalar_op, Sqr)):
        return None
    x = sq.inputs[0]
    if x.type.dtype == "float32":
        return x, "float32"
    if x.type.dtype != "float64":
        return None
    cast = x.owner
    if cast is not None and isinstance(cast.op, Elemwise) and \
            isinstance(cast.op.scalar_op, Cast) and cast.inputs[0].type.dtype == "float32":
        return cast.inputs[0], "float64"
    return x, "float64"


def sum_squares():
    """The rewrite: each tagged ``sum(sqr(float64(x)))`` becomes ``SumSquares(x)``."""
    import pytensor.tensor as pt
    from pytensor.graph.rewriting.basic import dfs_rewriter, node_rewriter
    from pytensor.tensor.math import Sum

    @node_rewriter([Sum])
    def local_sum_squares(fgraph, node):
        found = _squared_input(node)
        if found is None:
            return None
        register_numba()
        out = SumSquares(found[1])(found[0])
        dtype = node.outputs[0].type.dtype
        return [out if dtype == "float64" else pt.cast(out, dtype)]

    return dfs_rewriter(local_sum_squares)


def register_numba():
    """Register :class:`SumSquares`'s Numba code (once; imports numba)."""
    if "numba-sum-squares" in _registered:
        return
    try:
        from pytensor.link.numba.dispatch import basic as numba_basic
        from pytensor.link.numba.dispatch.basic import register_funcify_and_cache_key
    except ImportError:     # no Numba: the C code and perform() remain
        return

    @register_funcify_and_cache_key(SumSquares)
    def numba_funcify_SumSquares(op, node, **kwargs):
        square = np.dtype(op.square).type

        # reassociation only: NaN and infinity keep their meaning
        @numba_basic.numba_njit(fastmath={"reassoc", "contract"})
        def sum_squares(x):
            flat = np.ascontiguousarray(x).ravel()
            total = 0.0
            for i in range(flat.size):
                v = square(flat[i])
                total += np.float64(v * v)
            return np.asarray(total)

        return sum_squares, (f"lasagne_accum-sum-squares-{op.square}-"
                             f"{node.inputs[0].type.dtype}-{source_key(__file__)}")

    _registered.add("numba-sum-squares")
