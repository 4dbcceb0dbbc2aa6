"""A matrix product added into a buffer, and its sum of squares, chosen by the batch.

The gradient noise scale needs ``|x @ y|^2`` of every micro-batch's weight
gradient ``x @ y`` (``x`` m x k, ``y`` k x n, k the batch), whose product the C
and Numba modes add straight into the gradient buffer (``Gemm{inplace}``).
:func:`lasagne_accum.accumulate.squared_norm` takes it from the two k x k Gram
matrices, ``sum((x^T x) * (y y^T))``: cheap for small batches, but its flops
grow as ``k^2 (m + n)``, a third of the window's time at k = 256 on a 784 x 512
layer. :class:`GemmSquares` does the gemm and the squares in one op and picks
by the k of each call (:func:`use_gram`): for small k the gemm into the buffer
and the Gram matrices; for larger k the product once, into a scratch array,
and one pass that adds ``alpha`` times each element into the buffer and sums
the squares in float64.

In the C and Numba modes of :func:`lasagne_accum.mode` (other modes keep the
Gram form, which ``squared_norm`` tags):

* :func:`product_squares` (before PyTensor's rewrites) makes each tagged Gram
  sum a :class:`ProductSquares` placeholder of the product's two factors, so
  that the gradient's ``Dot`` keeps the buffer's sum as its only client and
  PyTensor's BLAS rewrite makes it a ``Gemm``;
* :func:`gemm_squares` (after the BLAS rewrite) makes each placeholder and the
  ``Gemm`` of the same factors one :class:`GemmSquares`, or, without such a
  ``Gemm`` (a float32 weight among float64 ones: the factors were cast), the Gram
  sum again;
* :func:`inplace` lets it write into the buffer.

The buffer gets the numbers of BLAS's own ``beta * z + alpha * x @ y`` (the
multiply-add fused, as OpenBLAS's kernels do); the sum differs from the Gram
form's in rounding only.
"""

from __future__ import annotations

import functools
import threading

import numpy as np
from pytensor.graph.basic import Apply
from pytensor.graph.op import Op
from pytensor.link.c.op import COp

from . import source_key

__all__ = ["GemmSquares", "ProductSquares", "TAG", "GRAM_RATIO", "use_gram",
           "product_squares", "gemm_squares", "inplace", "register_numba"]

#: The tag attribute :func:`lasagne_accum.accumulate.squared_norm` sets on a Gram sum.
TAG = "lasagne_accum_product_squares"

_registered: set[str] = set()


def _matrix_inputs(x, y):
    import pytensor.tensor as pt

    x, y = pt.as_tensor_variable(x), pt.as_tensor_variable(y)
    if x.type.ndim != 2 or y.type.ndim != 2:
        raise TypeError("x and y must be matrices")
    if x.type.dtype not in ("float32", "float64") or y.type.dtype != x.type.dtype:
        raise TypeError(f"x and y must both be float32 or both float64, got "
                        f"{x.type.dtype} and {y.type.dtype}")
    return x, y


def _squares(product):
    return np.asarray(np.sum(np.square(product, dtype=np.float64)))


class ProductSquares(Op):
    """``sum(float64(x @ y)^2)``: the placeholder :func:`gemm_squares` replaces."""

    __props__ = ()

    def make_node(self, x, y):
        import pytensor.tensor as pt

        x, y = _matrix_inputs(x, y)
        return Apply(self, [x, y], [pt.scalar(dtype="float64")])

    def perform(self, node, inputs, outputs):
        outputs[0][0] = _squares(np.dot(*inputs))

    def infer_shape(self, *args):
        return [()]


class GemmSquares(COp):
    """``(beta * z + alpha * x @ y, sum(float64(x @ y)^2))`` from one gemm of the product.

    Inputs as PyTensor's ``Gemm``: ``z`` (m x n), the scalar ``alpha``,
    ``x`` (m x k), ``y`` (k x n), the scalar ``beta``, all of one float
    dtype; ``z`` is not read when ``beta == 0`` (as BLAS). With `inplace`
    the first output is ``z``'s buffer. The squares come from the k x k Gram
    matrices or from the product itself, as :func:`use_gram` says for the
    call's shapes.
    """

    __props__ = ("inplace",)

    def __init__(self, inplace=False):
        self.inplace = bool(inplace)
        if self.inplace:
            self.destroy_map = {0: [0]}

    def make_node(self, z, alpha, x, y, beta):
        import pytensor.tensor as pt

        x, y = _matrix_inputs(x, y)
        z = pt.as_tensor_variable(z)
        alpha, beta = (pt.as_tensor_variable(v) for v in (alpha, beta))
        dtype = x.type.dtype
        if z.type.ndim != 2 or z.type.dtype != dtype or any(
                v.type.ndim != 0 or v.type.dtype != dtype for v in (alpha, beta)):
            raise TypeError(f"GemmSquares takes a {dtype} matrix z and {dtype} scalars "
                            f"alpha and beta, got {z.type}, {alpha.type}, {beta.type}")
        return Apply(self, [z, alpha, x, y, beta], [z.type(), pt.scalar(dtype="float64")])

    def perform(self, node, inputs, outputs):
        z, alpha, x, y, beta = inputs
        product = np.dot(x, y)
        if z.shape != product.shape:
            raise ValueError(f"GemmSquares: z is {z.shape}, x @ y is {product.shape}")
        out = z if self.inplace else np.array(z, copy=True, order="C")
        if beta == 0:
            out[...] = alpha * product
        else:
            out *= beta
            out += alpha * product
        outputs[0][0] = out
        m, k = x.shape
        if m and product.shape[1] and use_gram(m, product.shape[1], k):
            gram = np.dot(x.T, x).astype(np.float64) * np.dot(y, y.T).astype(np.float64)
            outputs[1][0] = np.asarray(gram.sum())
        else:
            outputs[1][0] = _squares(product)

    def infer_shape(self, *args):   # (fgraph, node, shapes); PyTensor 3.3: (node, shapes)
        shapes = args[-1]
        return [shapes[0], ()]

    # -- C ---------------------------------------------------------------------------
    def c_support_code(self, **kwargs):
        return [_C_SUPPORT, _add_squares("npy_float32", "fmaf"),
                _add_squares("npy_float64", "fma")]

    def c_headers(self, **kwargs):
        return ["<math.h>", "<stdlib.h>"]

    def c_libraries(self, **kwargs):
        from pytensor.tensor.blas import ldflags

        return ldflags()

    def c_compile_args(self, **kwargs):
        from pytensor.tensor.blas import ldflags

        return ldflags(libs=False, flags=True)

    def c_lib_dirs(self, **kwargs):
        from pytensor.tensor.blas import ldflags

        return ldflags(libs=False, libs_dir=True)

    def c_header_dirs(self, **kwargs):
        from pytensor.tensor.blas import ldflags

        return ldflags(libs=False, include_dir=True)

    def c_support_code_struct(self, node, name):
        return "void* scratch; size_t scratch_bytes;"

    def c_init_code_struct(self, node, name, sub):
        return "scratch = NULL; scratch_bytes = 0;"

    def c_cleanup_code_struct(self, node, name):
        return "free(scratch); scratch = NULL; scratch_bytes = 0;"

    def c_code_cache_version(self):
        return (3, source_key(__file__))

    def c_code(self, node, name, inputs, outputs, sub):
        from pytensor.configdefaults import config
        from pytensor.graph.utils import MethodNotDefined

        if not config.blas__ldflags:    # no BLAS to link: perform()
            raise MethodNotDefined("GemmSquares needs a BLAS")
        z, alpha, x, y, beta = inputs
        zout, sq = outputs
        fail = sub["fail"]
        dtype = node.inputs[0].type.dtype
        t = {"float32": "npy_float32", "float64": "npy_float64"}[dtype]
        gemm = {"float32": "sgemm_", "float64": "dgemm_"}[dtype]
        if self.inplace:
            take_z = f"""
            Py_XDECREF({zout});
            {zout} = {z};
            Py_INCREF({zout});
            """
        else:
            take_z = f"""
            Py_XDECREF({zout});
            {zout} = (PyArrayObject*)PyArray_NewCopy({z}, NPY_CORDER);
            if ({zout} == NULL) {{ {fail} }}
            """
        return f"""
        {{
            if (PyArray_NDIM({x}) != 2 || PyArray_NDIM({y}) != 2 || PyArray_NDIM({z}) != 2) {{
                PyErr_SetString(PyExc_ValueError, "GemmSquares: x, y and z must be matrices");
                {fail}
            }}
            const npy_intp m = PyArray_DIMS({x})[0], k = PyArray_DIMS({x})[1];
            const npy_intp n = PyArray_DIMS({y})[1];
            if (PyArray_DIMS({y})[0] != k || PyArray_DIMS({z})[0] != m
                    || PyArray_DIMS({z})[1] != n) {{
                PyErr_Format(PyExc_ValueError,
                             "GemmSquares: z is (%ld, %ld), x (%ld, %ld), y (%ld, %ld)",
                             (long)PyArray_DIMS({z})[0], (long)PyArray_DIMS({z})[1],
                             (long)m, (long)k, (long)PyArray_DIMS({y})[0], (long)n);
                {fail}
            }}
            if (m > INT_MAX || n > INT_MAX || k > INT_MAX) {{
                PyErr_SetString(PyExc_ValueError, "GemmSquares: a side longer than INT_MAX");
                {fail}
            }}
            {take_z}
            const {t} a = *({t}*)PyArray_DATA({alpha});
            const {t} b = *({t}*)PyArray_DATA({beta});
            PyArrayObject* xc = NULL; PyArrayObject* yc = NULL; PyArrayObject* zc = NULL;
            int ldx = 1, ldy = 1, yl = 0;
            double total = 0.0;
            const int xl = la_gs_matrix({x}, &xc, &ldx);
            int ok = xl != 0;
            if (ok) {{ yl = la_gs_matrix({y}, &yc, &ldy); ok = yl != 0; }}
            PyArrayObject* zw = {zout};
            if (ok && !PyArray_IS_C_CONTIGUOUS(zw)) {{  /* write into a C-ordered copy */
                zc = (PyArrayObject*)PyArray_NewCopy(zw, NPY_CORDER);
                if (zc == NULL) ok = 0; else zw = zc;
            }}
            if (ok && m > 0 && n > 0) {{
                const {t}* xp = ({t}*)PyArray_DATA(xc ? xc : {x});
                const {t}* yp = ({t}*)PyArray_DATA(yc ? yc : {y});
                const int gram = LA_GS_GRAM(m, n, k);
                /* rows of the product per gemm: a block that stays in cache */
                npy_intp rows = LA_GS_BLOCK / n;
                if (rows < 1) rows = 1;
                if (rows > m) rows = m;
                ok = la_gs_reserve(&scratch, &scratch_bytes, (gram ? (size_t)k * (size_t)k * 2
                                   : (size_t)rows * (size_t)n) * sizeof({t}));
                if (ok && gram) {{
                    /* the product into z by BLAS (as Gemm), the squares from the k x k Grams */
                    int mi = (int)m, ni = (int)n, ki = (int)k, ldz = (int)n;
                    char ta = yl == 2 ? 'N' : 'T', tb = xl == 2 ? 'N' : 'T';
                    {gemm}(&ta, &tb, &ni, &mi, &ki, &a, yp, &ldy, xp, &ldx, &b,
                           ({t}*)PyArray_DATA(zw), &ldz);
                    const {t} one = 1, zero = 0;
                    {t}* g1 = ({t}*)scratch;
                    {t}* g2 = g1 + (npy_intp)k * k;
                    /* column-major k x k: g1 = x^T x, g2 = y y^T */
                    char n1 = xl == 2 ? 'N' : 'T', t1 = xl == 2 ? 'T' : 'N';
                    {gemm}(&n1, &t1, &ki, &ki, &mi, &one, xp, &ldx, xp, &ldx, &zero, g1, &ki);
                    char n2 = yl == 2 ? 'T' : 'N', t2 = yl == 2 ? 'N' : 'T';
                    {gemm}(&n2, &t2, &ki, &ki, &ni, &one, yp, &ldy, yp, &ldy, &zero, g2, &ki);
                    total = la_gs_dot_{dtype}(g1, g2, (npy_intp)k * k);
                }} else if (ok) {{   /* the product into the scratch, then one pass */
                    {t}* zp = ({t}*)PyArray_DATA(zw);
                    for (npy_intp r0 = 0; r0 < m; r0 += rows) {{
                        const npy_intp r1 = r0 + rows < m ? r0 + rows : m;
                        int mb = (int)(r1 - r0), ni = (int)n, ki = (int)k;
                        /* the row-major block T (mb x n): column-major T^T = y^T x^T */
                        char ta = yl == 2 ? 'N' : 'T', tb = xl == 2 ? 'N' : 'T';
                        const {t} one = 1, zero = 0;
                        const {t}* xb = xp + (xl == 2 ? r0 * (npy_intp)ldx : r0);
                        {t}* tp = ({t}*)scratch;
                        if (k == 0) {{
                            memset(tp, 0, (size_t)mb * (size_t)n * sizeof({t}));
                        }} else {{
                            {gemm}(&ta, &tb, &ni, &mb, &ki, &one, yp, &ldy, xb, &ldx, &zero,
                                   tp, &ni);
                        }}
                        total += la_gs_add_squares_{dtype}(zp + r0 * n, tp, (npy_intp)mb * n,
                                                           a, b);
                    }}
                }}
            }}
            if (ok && zc != NULL && PyArray_CopyInto({zout}, zc) != 0) ok = 0;
            Py_XDECREF(xc); Py_XDECREF(yc); Py_XDECREF(zc);
            if (!ok) {{ {fail} }}
            if ({sq} == NULL || PyArray_NDIM({sq}) != 0 || PyArray_TYPE({sq}) != NPY_FLOAT64) {{
                Py_XDECREF({sq});
                {sq} = (PyArrayObject*)PyArray_ZEROS(0, NULL, NPY_FLOAT64, 0);
                if ({sq} == NULL) {{ {fail} }}
            }}
            *(npy_float64*)PyArray_DATA({sq}) = total;
        }}
        """


#: elements of the product per BLAS call (a block of rows): the scratch's size
BLOCK = 1 << 20

#: The squares come from the k x k Gram matrices while ``k^2 (m + n) <= GRAM_RATIO m n``
#: (``k`` the batch): their two products cost ``2 k^2 (m + n)`` flops, a tenth of a
#: 784 x 512 layer's at k = 64 but growing with k, while the pass over the product is
#: three parameter-sized streams of memory whatever k. On a 784 x 512 weight the Gram is
#: taken up to k = 65 (the two were about even at k = 64 on the machines measured).
GRAM_RATIO = 14.0


def use_gram(m: int, n: int, k: int) -> bool:
    """Whether :class:`GemmSquares` takes the squares of an ``(m, k) @ (k, n)`` product
    from its Gram matrices (see :data:`GRAM_RATIO`); never for an empty batch (k = 0),
    whose Gram matrices BLAS cannot take (leading dimension 0)."""
    return k > 0 and k * k * (m + n) <= GRAM_RATIO * m * n

_C_SUPPORT = f"""
#ifndef LA_GS_BLOCK
#define LA_GS_BLOCK {BLOCK}
/* the squares from the Gram matrices while k^2 (m + n) <= GRAM_RATIO m n and k > 0 */
#define LA_GS_GRAM(m, n, k) \
    ((k) > 0 && (double)(k) * (double)(k) * ((double)(m) + (double)(n)) \\
     <= {GRAM_RATIO} * (double)(m) * (double)(n))
#include <limits.h>
#include <string.h>
/* as PyTensor's BLAS header declares them (a declaration repeated, identical) */
extern "C" {{
void sgemm_(char*, char*, const int*, const int*, const int*, const float *, const float *,
            const int*, const float *, const int*, const float *, float *, const int*);
void dgemm_(char*, char*, const int*, const int*, const int*, const double *, const double *,
            const int*, const double *, const int*, const double *, double *, const int*);
}}
/* 1 if `a` is a column-major BLAS matrix, 2 if row-major (its leading dimension in *ld),
   0 if BLAS cannot take its layout */
static int la_gs_layout(PyArrayObject* a, int* ld) {{
    const npy_intp item = PyArray_ITEMSIZE(a);
    const npy_intp r = PyArray_DIMS(a)[0], c = PyArray_DIMS(a)[1];
    const npy_intp s0 = PyArray_STRIDES(a)[0], s1 = PyArray_STRIDES(a)[1];
    if ((r <= 1 || s0 == item) &&
            (c <= 1 || (s1 > 0 && s1 % item == 0 && s1 / item >= (r > 1 ? r : 1)))) {{
        npy_intp l = c > 1 ? s1 / item : (r > 1 ? r : 1);
        if (l > INT_MAX) return 0;
        *ld = (int)l;
        return 1;
    }}
    if ((c <= 1 || s1 == item) &&
            (r <= 1 || (s0 > 0 && s0 % item == 0 && s0 / item >= (c > 1 ? c : 1)))) {{
        npy_intp l = r > 1 ? s0 / item : (c > 1 ? c : 1);
        if (l > INT_MAX) return 0;
        *ld = (int)l;
        return 2;
    }}
    return 0;
}}
/* `a` as BLAS takes it: its layout (as la_gs_layout) and leading dimension, through a
   C-ordered copy in *copy where its strides do not do; 0 if that copy fails */
static int la_gs_matrix(PyArrayObject* a, PyArrayObject** copy, int* ld) {{
    int layout = la_gs_layout(a, ld);
    if (layout) return layout;
    *copy = (PyArrayObject*)PyArray_FromAny((PyObject*)a, NULL, 2, 2,
                                            NPY_ARRAY_C_CONTIGUOUS, NULL);
    if (*copy == NULL) return 0;
    layout = la_gs_layout(*copy, ld);
    if (!layout) {{   /* an empty matrix, whose strides numpy leaves as they were */
        const npy_intp cols = PyArray_DIMS(a)[1];
        *ld = cols > 1 ? (int)cols : 1;
        layout = 2;
    }}
    return layout;
}}
/* the scratch at least `need` bytes long; 0 (a MemoryError set) if it cannot be */
static int la_gs_reserve(void** scratch, size_t* bytes, const size_t need) {{
    if (need <= *bytes) return 1;
    free(*scratch);
    *scratch = malloc(need);
    *bytes = *scratch ? need : 0;
    if (*scratch == NULL) {{ PyErr_NoMemory(); return 0; }}
    return 1;
}}
#endif
"""


def _add_squares(ctype, fma):
    """C: ``z = beta * z + alpha * t`` (the multiply-add fused, as BLAS kernels do; ``z``
    not read when ``beta == 0``) and the float64 sum of ``t``'s squares, in one pass with
    16 partial sums (a function of its own, so that the compiler vectorizes it)."""
    name = {"npy_float32": "float32", "npy_float64": "float64"}[ctype]
    body = {"0": "z[i] = a * v", "1": f"z[i] = {fma}(a, v, z[i])",
            "b": f"z[i] = {fma}(a, v, b * z[i])"}

    def loop(update):
        return f"""
        for (; i + 16 <= count; i += 16) {{
            for (int j = 0; j < 16; ++j) {{
                const {ctype} v = t[i + j];
                {update.replace("[i]", "[i + j]")};
                s[j] += (double)v * (double)v;
            }}
        }}
        for (; i < count; ++i) {{
            const {ctype} v = t[i];
            {update};
            s[0] += (double)v * (double)v;
        }}"""

    # not inlined: inside the op's code the compiler keeps it scalar
    return f"""
__attribute__((noinline))
static double la_gs_dot_{name}(const {ctype}* __restrict__ g1, const {ctype}* __restrict__ g2,
                             const npy_intp count) {{
    double s[16] = {{0}};
    npy_intp i = 0;
    for (; i + 16 <= count; i += 16)
        for (int j = 0; j < 16; ++j) s[j] += (double)g1[i + j] * (double)g2[i + j];
    for (; i < count; ++i) s[0] += (double)g1[i] * (double)g2[i];
    double total = 0;
    for (int j = 0; j < 16; ++j) total += s[j];
    return total;
}}

__attribute__((noinline))
static double la_gs_add_squares_{name}({ctype}* __restrict__ z, const {ctype}* __restrict__ t,
                                      const npy_intp count, const {ctype} a, const {ctype} b) {{
    double s[16] = {{0}};
    npy_intp i = 0;
    if (b == 0) {{ {loop(body["0"])} }}
    else if (b == 1) {{ {loop(body["1"])} }}
    else {{ {loop(body["b"])} }}
    double total = 0;
    for (int j = 0; j < 16; ++j) total += s[j];
    return total;
}}
"""


def _gram_factors(node):
    """``(a, b)`` of a tagged ``sum(dot(a.T, a) * dot(b, b.T))``, or None."""
    from pytensor.tensor.blockwise import Blockwise
    from pytensor.tensor.elemwise import DimShuffle, Elemwise
    from pytensor.scalar.basic import Mul
    from pytensor.tensor.math import Dot, Sum

    if not getattr(node.outputs[0].tag, TAG, False) or not isinstance(node.op, Sum):
        return None

    def dot_inputs(v):
        op = getattr(v.owner, "op", None)
        core = op.core_op if isinstance(op, Blockwise) else op
        return v.owner.inputs if isinstance(core, Dot) else None

    def transposed(v, of):
        op = getattr(v.owner, "op", None)
        return isinstance(op, DimShuffle) and op.new_order == (1, 0) and v.owner.inputs[0] is of

    mul = node.inputs[0].owner
    if mul is None or not (isinstance(mul.op, Elemwise) and isinstance(mul.op.scalar_op, Mul)
                           and len(mul.inputs) == 2):
        return None
    left, right = (dot_inputs(v) for v in mul.inputs)
    if left is None or right is None:
        return None
    a, b = left[1], right[0]
    if not (transposed(left[0], a) and transposed(right[1], b)):
        return None
    return a, b


def product_squares():
    """The rewrite: each tagged Gram sum becomes :class:`ProductSquares` of its factors."""
    import pytensor.tensor as pt
    from pytensor.graph.rewriting.basic import dfs_rewriter, node_rewriter
    from pytensor.tensor.math import Sum

    @node_rewriter([Sum])
    def local_product_squares(fgraph, node):
        found = _gram_factors(node)
        if found is None:
            return None
        out = ProductSquares()(*found)
        dtype = node.outputs[0].type.dtype
        return [out if dtype == "float64" else pt.cast(out, dtype)]

    return dfs_rewriter(local_product_squares)


def gemm_squares():
    """The rewrite: a :class:`ProductSquares` and the ``Gemm`` of the same two factors
    become one :class:`GemmSquares`; a placeholder without one, the Gram sum again."""
    from pytensor.graph.rewriting.basic import GraphRewriter
    from pytensor.tensor.blas import Gemm
    from pytensor.tensor.math import dot

    class GemmSquaresRewriter(GraphRewriter):
        def add_requirements(self, fgraph):
            pass

        def apply(self, fgraph):
            for node in list(fgraph.toposort()):
                if not isinstance(node.op, ProductSquares) or node not in fgraph.apply_nodes:
                    continue
                x, y = node.inputs
                partner = next((c for c, _ in fgraph.clients[x]
                                if isinstance(c, Apply) and isinstance(c.op, Gemm)
                                and not c.op.inplace and c.inputs[2] is x
                                and c.inputs[3] is y), None)
                if partner is not None:
                    register_numba()
                    new = GemmSquares()(*partner.inputs)
                    fgraph.replace_all_validate(
                        [(partner.outputs[0], new[0]), (node.outputs[0], new[1])],
                        reason="lasagne_accum_gemm_squares")
                else:   # the Gram sum as it was built (its factors' dtypes differ from
                    # the Gemm's, or no Gemm was made)
                    gram = (dot(x.T, x) * dot(y, y.T)).sum(dtype="float64")
                    fgraph.replace_all_validate([(node.outputs[0], gram)],
                                                reason="lasagne_accum_gemm_squares")

    return GemmSquaresRewriter()


def inplace():
    """The rewrite: each :class:`GemmSquares` writes into its ``z`` where PyTensor's
    destroy handler allows it (as ``Gemm{inplace}`` does)."""
    from pytensor.graph.rewriting.basic import GraphRewriter
    from pytensor.graph.utils import InconsistencyError

    class GemmSquaresInplace(GraphRewriter):
        def add_requirements(self, fgraph):
            pass

        def apply(self, fgraph):
            if not hasattr(fgraph, "destroyers"):
                return
            for node in list(fgraph.toposort()):
                if not isinstance(node.op, GemmSquares) or node.op.inplace:
                    continue
                new = GemmSquares(inplace=True).make_node(*node.inputs).outputs
                try:
                    fgraph.replace_all_validate(list(zip(node.outputs, new)),
                                                reason="lasagne_accum_gemm_squares_inplace")
                except InconsistencyError:
                    pass

    return GemmSquaresInplace()


_local = threading.local()


def _scratch(dtype: str, size: int) -> np.ndarray:
    """A float array of at least `size` elements, kept per thread for the Numba code: a
    new product-sized array at each call costs the kernel's page faults (each trainer
    thread of the parameter server gets its own)."""
    kept = getattr(_local, "scratch", None)
    if kept is None:
        kept = _local.scratch = {}
    have = kept.get(dtype)
    if have is None or have.size < size:
        have = kept[dtype] = np.empty(size, dtype=dtype)
    return have[:size]


def register_numba():
    """Register :class:`GemmSquares`'s Numba code (once; imports numba)."""
    if "numba-gemm-squares" in _registered:
        return
    try:
        from pytensor.link.numba.dispatch import basic as numba_basic
        from pytensor.link.numba.dispatch.basic import register_funcify_and_cache_key
    except ImportError:     # no Numba: the C code and perform() remain
        return

    import numba

    from .gemm import _numba_gemm_kernels

    gemm_into = _numba_gemm_kernels()

    @functools.cache
    def kernel(dtype, inplace):
        run = gemm_into(dtype)
        scalar = np.dtype(dtype).type
        vector = numba.types.Array(numba.from_dtype(np.dtype(dtype)), 1, "C")

        @numba_basic.numba_njit
        def scratch_of(size):
            with numba.objmode(out=vector):
                out = _scratch(dtype, size)
            return out

        # contract: the multiply-add fused, as BLAS kernels do; reassoc: the sum vectorizes
        @numba_basic.numba_njit(fastmath={"contract", "reassoc"})
        def add_and_square(z, t, alpha, beta):
            s = 0.0
            if beta == 0:
                for i in range(t.size):
                    v = t[i]
                    s += np.float64(v) * np.float64(v)
                    z[i] = alpha * v
            elif beta == 1:
                for i in range(t.size):
                    v = t[i]
                    s += np.float64(v) * np.float64(v)
                    z[i] = z[i] + alpha * v
            else:
                for i in range(t.size):
                    v = t[i]
                    s += np.float64(v) * np.float64(v)
                    z[i] = beta * z[i] + alpha * v
            return s

        gram_rule = numba_basic.numba_njit(use_gram)

        @numba_basic.numba_njit(fastmath={"reassoc"})
        def gram_dot(g1, g2):
            s = 0.0
            for i in range(g1.size):
                s += np.float64(g1[i]) * np.float64(g2[i])
            return s

        @numba_basic.numba_njit
        def gemm_squares(z, alpha, x, y, beta):
            m, k = x.shape
            n = y.shape[1]
            if y.shape[0] != k or z.shape[0] != m or z.shape[1] != n:
                raise ValueError("GemmSquares: the shapes of z, x and y do not agree")
            a, b = scalar(alpha.item()), scalar(beta.item())
            out = z if inplace else z.copy()
            if m > 0 and n > 0 and gram_rule(m, n, k):
                run(out, a, x, y, b)   # as Gemm; the squares from the k x k Gram matrices
                g1 = np.empty((k, k), dtype=z.dtype)
                g2 = np.empty((k, k), dtype=z.dtype)
                run(g1, 1.0, x.T, x, 0.0)
                run(g2, 1.0, y, y.T, 0.0)
                return out, np.asarray(gram_dot(g1.ravel(), g2.ravel()))
            flat = np.ascontiguousarray(out).reshape(m * n)
            rows = max(1, min(m, BLOCK // max(1, n)))
            scratch = scratch_of(rows * n)
            total = 0.0
            for r0 in range(0, m, rows):
                r1 = min(m, r0 + rows)
                t = scratch[:(r1 - r0) * n]
                if k == 0:   # an empty batch: a zero product (BLAS would refuse ld = 0)
                    t[:] = 0
                else:
                    run(t.reshape((r1 - r0, n)), 1.0, x[r0:r1], y, 0.0)
                total += add_and_square(flat[r0 * n:r1 * n], t, a, b)
            if m * n > 0 and flat.ctypes.data != out.ctypes.data:
                out[...] = flat.reshape((m, n))
            return out, np.asarray(total)

        return gemm_squares

    @register_funcify_and_cache_key(GemmSquares)
    def numba_funcify_GemmSquares(op, node, **kwargs):
        dtype = node.inputs[0].type.dtype
        return kernel(dtype, op.inplace), (f"lasagne_accum-gemm-squares-{dtype}-{op.inplace}-"
                                            f"{BLOCK}-{GRAM_RATIO}-{source_key(__file__)}")

    _registered.add("numba-gemm-squares")
