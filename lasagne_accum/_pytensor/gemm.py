"""Matrix products added into a buffer in place: ``acc + dot(a, b)`` as one BLAS gemm.

* **Numba.** The C backend turns ``acc + dot(a, b)`` into ``Gemm{inplace}``:
  one BLAS call that adds the product into the buffer (``beta = 1``). The
  Numba backend leaves PyTensor's BLAS rewrites out, so there the same update
  computes the product into a new array and then adds it: a parameter-sized
  temporary per call. :func:`numba_gemm_rewrites` runs the C backend's Gemm
  rewrite in Numba modes (``Dot`` + scaled ``Add`` -> ``Gemm``; PyTensor's own
  in-place pass then makes it ``Gemm{inplace}``), and :func:`to_numba_gemm`
  hands each ``Gemm`` to :class:`NumbaGemm`, whose Numba code calls the
  ``sgemm``/``dgemm`` of scipy's BLAS (the library Numba's own ``np.dot``
  calls), writing into the buffer.

* **The lazy reset.** The single-function form starts a window with
  ``select(stale, 0, acc) + dot(x, y)`` (a select: ``0 * acc`` would keep a
  NaN). :func:`gemm_reset` folds the select into the ``Gemm``'s ``beta``
  (``select(stale, 0, beta)``; BLAS does not read the buffer when
  ``beta = 0``), so the buffer is updated in place with no buffer-sized select
  per call, in C and Numba.
"""

from __future__ import annotations

import functools

import numpy as np
from pytensor.tensor.blas import Dot22, Gemm

from . import source_key

__all__ = ["NumbaGemm", "NumbaDot22", "numba_gemm_rewrites", "gemm_reset", "to_numba_gemm",
           "register_numba"]

_registered: set[str] = set()


class NumbaGemm(Gemm):
    """PyTensor's ``Gemm`` with a Numba implementation through BLAS.

    ``gemm(z, a, x, y, b) = b * z + a * x @ y`` (``z`` not read when
    ``b == 0``, as BLAS); the in-place op writes into ``z``'s buffer. Only
    :func:`to_numba_gemm` makes it, in modes of :func:`lasagne_accum.mode`;
    its Numba code is registered for this class alone.
    """


class NumbaDot22(Dot22):
    """PyTensor's ``Dot22`` (a float32 or float64 matrix product) with a Numba
    implementation through BLAS gemm: an operand that is a transpose (``W.T`` in a
    backward pass) is handed to BLAS as transposed, where Numba's ``np.dot``
    copies it first. Only :func:`numba_gemm_rewrites` makes it.
    """


def numba_gemm_rewrites():
    """The C backend's Gemm rewrite, for Numba modes (a ``SequenceDB``).

    ``Dot`` becomes ``Dot22`` for the search, PyTensor's ``GemmOptimizer``
    folds ``beta * z + alpha * Dot22(x, y)`` sums into ``Gemm``, and the
    ``Dot22`` left over become :class:`NumbaDot22` (float32 and float64: one
    BLAS gemm, transposed operands included) or ``Dot`` again (other dtypes).
    """
    from pytensor.graph.rewriting.basic import dfs_rewriter, node_rewriter
    from pytensor.graph.rewriting.db import SequenceDB
    from pytensor.tensor.math import _dot
    from pytensor.tensor.rewriting.blas import GemmOptimizer, local_dot_to_dot22

    @node_rewriter([Dot22])
    def local_dot22_to_dot(fgraph, node):
        if isinstance(node.op, NumbaDot22):
            return None
        if node.outputs[0].type.dtype in ("float32", "float64"):
            register_numba()
            return NumbaDot22().make_node(*node.inputs).outputs
        return [_dot(*node.inputs)]

    seq = SequenceDB()
    seq.register("lasagne_accum_dot_to_dot22", dfs_rewriter(local_dot_to_dot22), "numba",
                 position=0)
    seq.register("lasagne_accum_gemm", GemmOptimizer(), "numba", position=10)
    seq.register("lasagne_accum_dot22_to_dot", dfs_rewriter(local_dot22_to_dot), "numba",
                 position=20)
    return seq


def is_scalar_zero(v) -> bool:
    """``v`` is a scalar constant 0 (after PyTensor's constant folding of casts and fills)."""
    import pytensor.tensor as pt
    from pytensor.tensor.exceptions import NotScalarConstantError

    try:
        return bool(pt.get_underlying_scalar_constant_value(v) == 0)
    except NotScalarConstantError:
        return False


def gemm_reset():
    """``gemm(switch(c, 0, z), a, x, y, b)`` -> ``gemm(z, a, x, y, switch(c, 0, b))``.

    Exact, NaN included: with ``beta = 0`` BLAS gemm does not read its output's
    old values (the reference BLAS contract, "when BETA is supplied as zero
    then C need not be set on input", which OpenBLAS and scipy's BLAS keep:
    ``tests/test_fast_paths.py`` checks it), and so do ``Gemm``'s Python and
    Numba code paths.
    """
    import pytensor.tensor as pt
    from pytensor.graph.rewriting.basic import dfs_rewriter, node_rewriter
    from pytensor.scalar.basic import Switch
    from pytensor.tensor.elemwise import Elemwise

    @node_rewriter([Gemm])
    def local_gemm_select_reset(fgraph, node):
        z, alpha, x, y, beta = node.inputs
        sel = z.owner
        if sel is None or not (isinstance(sel.op, Elemwise)
                               and isinstance(sel.op.scalar_op, Switch)):
            return None
        cond, if_true, if_false = sel.inputs
        if not all(cond.type.broadcastable):  # one condition for the whole matrix
            return None
        flag = cond.dimshuffle([]) if cond.type.ndim else cond
        zero = np.zeros((), beta.type.dtype)
        if is_scalar_zero(if_true) and if_false.type == z.type:
            kept, new_beta = if_false, pt.switch(flag, zero, beta)
        elif is_scalar_zero(if_false) and if_true.type == z.type:
            kept, new_beta = if_true, pt.switch(flag, beta, zero)
        else:
            return None
        return [node.op(kept, alpha, x, y, new_beta)]

    return dfs_rewriter(local_gemm_select_reset)


def to_numba_gemm():
    """Hand every ``Gemm`` to :class:`NumbaGemm` (same inputs, same in-place flag)."""
    from pytensor.graph.rewriting.basic import dfs_rewriter, node_rewriter

    @node_rewriter([Gemm])
    def local_numba_gemm(fgraph, node):
        if isinstance(node.op, NumbaGemm):
            return None
        register_numba()
        return NumbaGemm(node.op.inplace).make_node(*node.inputs).outputs

    return dfs_rewriter(local_numba_gemm)


def _blas_address(name):
    from scipy.linalg import cython_blas  # noqa: F401  (loads the module)
    from numba.core.extending import get_cython_function_address

    return get_cython_function_address("scipy.linalg.cython_blas", name)


def _numba_gemm_kernels():
    """Numba functions ``blas_gemm(dtype)`` and ``gemm_into(z, alpha, x, y, beta)``."""
    import numba
    import numpy as np
    from numba import types
    from numba.core import cgutils
    from numba.core.extending import intrinsic
    from pytensor.link.numba.cache import _call_cached_ptr
    from pytensor.link.numba.dispatch.basic import numba_njit

    @intrinsic
    def address_of(typingctx, value):
        """A pointer to a stack copy of `value` (Fortran passes by reference)."""
        if isinstance(value, types.Literal):
            return None

        def codegen(context, builder, signature, args):
            return cgutils.alloca_once_value(builder, args[0])

        return types.CPointer(value)(value), codegen

    i8p, i32p = types.CPointer(types.int8), types.CPointer(types.int32)

    def blas_gemm(kind):
        nb_float = {"s": types.float32, "d": types.float64}[kind]
        fp = types.CPointer(nb_float)
        fn_type = types.FunctionType(
            types.void(i8p, i8p, i32p, i32p, i32p, fp, fp, i32p, fp, i32p, fp, fp, i32p))
        cache_name = f"lasagne_accum_{kind}gemm"
        name = f"{kind}gemm"

        @numba_njit
        def get_pointer():
            with numba.objmode(ptr=types.intp):
                ptr = _blas_address(name)
            return ptr

        @numba_njit
        def call(transa, transb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc):
            fn = _call_cached_ptr(get_ptr_func=get_pointer, func_type_ref=fn_type,
                                  unique_func_name_lit=cache_name)
            fn(address_of(transa), address_of(transb), address_of(m), address_of(n),
               address_of(k), address_of(alpha), a.ctypes, address_of(lda), b.ctypes,
               address_of(ldb), address_of(beta), c.ctypes, address_of(ldc))

        return call

    @numba_njit
    def layout(a):
        """(1, ld) if `a` is a column-major BLAS matrix, (2, ld) if row-major, else (0, 0)."""
        item = a.itemsize
        r, c = a.shape
        s0, s1 = a.strides
        if (r <= 1 or s0 == item) and (
                c <= 1 or (s1 > 0 and s1 % item == 0 and s1 // item >= max(1, r))):
            return 1, (s1 // item if c > 1 else max(1, r))
        if (c <= 1 or s1 == item) and (
                r <= 1 or (s0 > 0 and s0 % item == 0 and s0 // item >= max(1, c))):
            return 2, (s0 // item if r > 1 else max(1, c))
        return 0, 0

    kernels = {"float32": blas_gemm("s"), "float64": blas_gemm("d")}
    N, T = np.int8(ord("N")), np.int8(ord("T"))

    # one set of dispatchers per dtype, shared by every Gemm and Dot22 node of every graph:
    # each is compiled once per signature, not once per node
    @functools.cache
    def gemm_into(dtype):
        blas = kernels[dtype]
        scalar = np.dtype(dtype).type
        c_matrix = types.Array(numba.from_dtype(np.dtype(dtype)), 2, "C")

        # The copies for layouts BLAS cannot take run in object mode: compiled, numpy's
        # copy and assignment of arbitrarily strided arrays are a few seconds of Numba
        # compile per dtype and layout, for a path that ordinary graphs never take.
        @numba_njit
        def contiguous(a):
            with numba.objmode(c=c_matrix):
                c = np.ascontiguousarray(a)
            return c

        @numba_njit
        def copy_into(z, values):
            with numba.objmode():
                z[...] = values

        @numba_njit
        def run(z, alpha, x, y, beta):
            """z := beta * z + alpha * x @ y, in place (z has the product's shape)."""
            m, k = x.shape
            n = y.shape[1]
            if m == 0 or n == 0:
                return
            zl, ldz = layout(z)
            aside = zl == 0
            out = z
            if aside:  # a layout BLAS cannot write: compute into a row-major copy, copy in
                out = contiguous(z)
                zl, ldz = 2, max(1, n)
            xl, ldx = layout(x)
            if xl == 0:
                x = contiguous(x)
                xl, ldx = layout(x)
            yl, ldy = layout(y)
            if yl == 0:
                y = contiguous(y)
                yl, ldy = layout(y)
            if zl == 1:  # column-major Z (m x n) = alpha op(X) op(Y) + beta Z
                blas(N if xl == 1 else T, N if yl == 1 else T, np.int32(m), np.int32(n),
                     np.int32(k), scalar(alpha), x, np.int32(ldx), y, np.int32(ldy),
                     scalar(beta), out, np.int32(ldz))
            else:  # row-major Z is column-major Z^T (n x m) = alpha Y^T X^T + beta Z^T
                blas(N if yl == 2 else T, N if xl == 2 else T, np.int32(n), np.int32(m),
                     np.int32(k), scalar(alpha), y, np.int32(ldy), x, np.int32(ldx),
                     scalar(beta), out, np.int32(ldz))
            if aside:
                copy_into(z, out)

        return run

    return gemm_into


def register_numba():
    """Register :class:`NumbaGemm`'s Numba code (once; imports numba)."""
    if "numba-gemm" in _registered:
        return
    from pytensor.link.numba.dispatch import basic as numba_basic
    from pytensor.link.numba.dispatch.basic import register_funcify_and_cache_key

    import numba

    gemm_into = _numba_gemm_kernels()

    def _gemm_aside(z, a, x, y, b):
        """``b * z + a * x @ y`` in a new C-ordered array of z's dtype (z broadcast, or
        numpy's error for unaligned shapes); z is not read when b == 0 (as BLAS)."""
        product = a * np.dot(x, y)
        value = product + np.zeros_like(z) if b == 0 else b * z + product
        return np.ascontiguousarray(value, dtype=z.dtype)

    @functools.cache
    def gemm_aside(dtype):
        """:func:`_gemm_aside` for Numba, in object mode: the path of shapes that only
        broadcasting or an error can reconcile, which a compiled ``np.dot`` of arbitrary
        layouts would cost seconds of compile for."""
        c_matrix = numba.types.Array(numba.from_dtype(np.dtype(dtype)), 2, "C")

        @numba_basic.numba_njit
        def aside(z, a, x, y, b):
            with numba.objmode(value=c_matrix):
                value = _gemm_aside(z, a, x, y, b)
            return value

        return aside

    @register_funcify_and_cache_key(NumbaGemm)
    def numba_funcify_NumbaGemm(op, node, **kwargs):
        dtype = node.outputs[0].type.dtype
        inplace = bool(op.inplace)
        aside = gemm_aside(dtype)
        if dtype not in ("float32", "float64"):
            @numba_basic.numba_njit
            def gemm_generic(z, a, x, y, b):
                return aside(z, a.item(), x, y, b.item())

            return gemm_generic, f"lasagne_accum-gemm-generic-{dtype}-{source_key(__file__)}"
        run = gemm_into(dtype)

        @numba_basic.numba_njit
        def gemm(z, a, x, y, b):
            if x.shape[1] != y.shape[0] or z.shape[0] != x.shape[0] or \
                    z.shape[1] != y.shape[1]:
                return aside(z, a.item(), x, y, b.item())
            out = z if inplace else z.copy()
            run(out, a.item(), x, y, b.item())
            return out

        return gemm, f"lasagne_accum-gemm-{dtype}-{inplace}-{source_key(__file__)}"

    @register_funcify_and_cache_key(NumbaDot22)
    def numba_funcify_NumbaDot22(op, node, **kwargs):
        dtype = node.outputs[0].type.dtype
        run = gemm_into(dtype)

        @numba_basic.numba_njit
        def dot22(x, y):
            if x.shape[1] != y.shape[0]:
                raise ValueError("NumbaDot22: the matrices' inner dimensions differ")
            if x.shape[1] == 0:
                return np.zeros((x.shape[0], y.shape[1]), dtype=x.dtype)
            out = np.empty((x.shape[0], y.shape[1]), dtype=x.dtype)
            run(out, 1.0, x, y, 0.0)   # beta = 0: BLAS does not read out's values
            return out

        return dot22, f"lasagne_accum-dot22-{dtype}-{source_key(__file__)}"

    _registered.add("numba-gemm")
