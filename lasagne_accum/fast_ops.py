"""Fast paths for PyTensor's Numba backend (PyTensor 3's default).

* **In-place accumulation through BLAS.** The C backend turns
  ``acc + dot(a, b)`` into ``Gemm{inplace}``: one BLAS call that adds the
  product into the buffer (``beta = 1``). The Numba backend leaves PyTensor's
  BLAS rewrites out, so there the same update computes the product into a new
  array and then adds it: a parameter-sized temporary per call.
  :func:`register_numba_gemm_rewrite` adds, for the Numba backend only, the
  same rewrite the C backend runs (``Dot`` + scaled ``Add`` -> ``Gemm``;
  PyTensor's own in-place pass then makes it ``Gemm{inplace}``), and
  :func:`register_numba_gemm` gives ``Gemm`` a Numba implementation that calls
  the ``sgemm``/``dgemm`` of scipy's BLAS (the library Numba's own ``np.dot``
  calls), writing into the buffer.

Both are registered by :func:`lasagne_accum.backends.install` when the library
is imported (the Numba part once PyTensor loads its Numba dispatch).
"""

import hashlib
import pathlib

__all__ = ["register_numba_gemm_rewrite", "register_numba_gemm"]

_registered = set()
# Numba's on-disk cache is keyed by what a dispatcher says; the source's hash
# in the key makes every edit of this module compile afresh.
_SOURCE_KEY = hashlib.sha256(pathlib.Path(__file__).read_bytes()).hexdigest()[:16]


# --------------------------------------------------------------------------
# rewrite: Dot + Add -> Gemm, Numba backend only
# --------------------------------------------------------------------------
def register_numba_gemm_rewrite():
    """Run the C backend's Gemm rewrite in the Numba backend too (idempotent).

    ``Dot`` becomes ``Dot22`` for the search, PyTensor's ``GemmOptimizer``
    folds ``beta * z + alpha * Dot22(x, y)`` sums into ``Gemm``, and the
    ``Dot22`` left over become ``Dot`` again (their Numba code). Registered
    under the tag ``numba`` only: the C, JAX and PyTorch backends' graphs do
    not change.
    """
    if "gemm-rewrite" in _registered:
        return
    from pytensor.compile.mode import optdb
    from pytensor.graph.rewriting.basic import dfs_rewriter, node_rewriter
    from pytensor.graph.rewriting.db import SequenceDB
    from pytensor.tensor.blas import Dot22
    from pytensor.tensor.math import _dot
    from pytensor.tensor.rewriting.blas import GemmOptimizer, local_dot_to_dot22

    @node_rewriter([Dot22])
    def local_dot22_to_dot(fgraph, node):
        return [_dot(*node.inputs)]

    seq = SequenceDB()
    seq.register("lasagne_accum_dot_to_dot22", dfs_rewriter(local_dot_to_dot22), "numba",
                 position=0)
    seq.register("lasagne_accum_gemm", GemmOptimizer(), "numba", position=10)
    seq.register("lasagne_accum_dot22_to_dot", dfs_rewriter(local_dot22_to_dot), "numba",
                 position=20)
    # where the C backend's BlasOpt runs: after stabilisation, before specialisation
    optdb.register("lasagne_accum_numba_gemm", seq, "numba", position=1.71)
    _registered.add("gemm-rewrite")


# --------------------------------------------------------------------------
# Numba implementation of Gemm
# --------------------------------------------------------------------------
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

    @numba_njit(inline="always")
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

    def gemm_into(dtype):
        blas = kernels[dtype]
        scalar = np.dtype(dtype).type

        @numba_njit
        def run_contiguous(z, alpha, x, y, beta):
            m, k = x.shape
            n = y.shape[1]
            xl, ldx = layout(x)
            if xl == 0:
                x = np.ascontiguousarray(x)
                xl, ldx = layout(x)
            yl, ldy = layout(y)
            if yl == 0:
                y = np.ascontiguousarray(y)
                yl, ldy = layout(y)
            blas(N if yl == 2 else T, N if xl == 2 else T, np.int32(n), np.int32(m),
                 np.int32(k), scalar(alpha), y, np.int32(ldy), x, np.int32(ldx),
                 scalar(beta), z, np.int32(max(1, n)))

        @numba_njit
        def run(z, alpha, x, y, beta):
            """z := beta * z + alpha * x @ y, in place (z has the product's shape)."""
            m, k = x.shape
            n = y.shape[1]
            if m == 0 or n == 0:
                return
            zl, ldz = layout(z)
            if zl == 0:  # a layout BLAS cannot write: compute aside, copy in
                tmp = np.ascontiguousarray(z)
                run_contiguous(tmp, alpha, x, y, beta)
                z[...] = tmp
                return
            xl, ldx = layout(x)
            if xl == 0:
                x = np.ascontiguousarray(x)
                xl, ldx = layout(x)
            yl, ldy = layout(y)
            if yl == 0:
                y = np.ascontiguousarray(y)
                yl, ldy = layout(y)
            if zl == 1:  # column-major Z (m x n) = alpha op(X) op(Y) + beta Z
                blas(N if xl == 1 else T, N if yl == 1 else T, np.int32(m), np.int32(n),
                     np.int32(k), scalar(alpha), x, np.int32(ldx), y, np.int32(ldy),
                     scalar(beta), z, np.int32(ldz))
            else:  # row-major Z is column-major Z^T (n x m) = alpha Y^T X^T + beta Z^T
                blas(N if yl == 2 else T, N if xl == 2 else T, np.int32(n), np.int32(m),
                     np.int32(k), scalar(alpha), y, np.int32(ldy), x, np.int32(ldx),
                     scalar(beta), z, np.int32(ldz))

        return run

    return gemm_into


def register_numba_gemm():
    """Give PyTensor's ``Gemm`` a Numba implementation through BLAS (idempotent; imports numba)."""
    if "numba-gemm" in _registered:
        return
    import numpy as np
    from pytensor.link.numba.dispatch import basic as numba_basic
    from pytensor.link.numba.dispatch.basic import register_funcify_and_cache_key
    from pytensor.tensor.blas import Gemm

    gemm_into = _numba_gemm_kernels()

    @numba_basic.numba_njit
    def _dot(x, y):
        return np.dot(np.ascontiguousarray(x), np.ascontiguousarray(y))

    @register_funcify_and_cache_key(Gemm)
    def numba_funcify_Gemm(op, node, **kwargs):
        dtype = node.outputs[0].type.dtype
        inplace = bool(op.inplace)
        if dtype not in ("float32", "float64"):
            @numba_basic.numba_njit
            def gemm_generic(z, a, x, y, b):
                return np.asarray(b.item() * z + a.item() * _dot(x, y)).astype(z.dtype)

            return gemm_generic, f"lasagne_accum-gemm-generic-{dtype}-{_SOURCE_KEY}"
        run = gemm_into(dtype)

        if inplace:
            @numba_basic.numba_njit
            def gemm(z, a, x, y, b):
                if x.shape[1] != y.shape[0] or z.shape[0] != x.shape[0] or \
                        z.shape[1] != y.shape[1]:
                    return np.asarray(b.item() * z + a.item() * _dot(x, y))
                run(z, a.item(), x, y, b.item())
                return z
        else:
            @numba_basic.numba_njit
            def gemm(z, a, x, y, b):
                if x.shape[1] != y.shape[0] or z.shape[0] != x.shape[0] or \
                        z.shape[1] != y.shape[1]:
                    return np.asarray(b.item() * z + a.item() * _dot(x, y))
                out = z.copy()
                run(out, a.item(), x, y, b.item())
                return out

        return gemm, f"lasagne_accum-gemm-{dtype}-{inplace}-{_SOURCE_KEY}"

    _registered.add("numba-gemm")
