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

* **The lazy reset, in place.** The single-function form starts a window
  with ``select(stale, 0, acc) + dot(x, y)`` (a select: ``0 * acc`` would
  keep a NaN; ``stale`` holds on a window's first call unless the stepping
  call before it left the buffers zeroed). :func:`register_gemm_reset_rewrite`
  folds the select into the ``Gemm``'s ``beta`` (``select(stale, 0, beta)``;
  BLAS does not read the buffer when ``beta = 0``), so the buffer is updated
  in place, with no buffer-sized select per call, in C and Numba.

* **A lazy step that costs nothing.** The single-function form
  (``average=N``) selects the rule's new values, and the gradient buffers'
  zeros, with ``ifelse(keep, states, new_values)``. PyTensor's ``IfElse``
  copies the branch it returns when that is the new values (C), and the
  Numba backend computes both branches on every call.
  :func:`register_lazy_step_rewrite` turns that ``IfElse`` (its unchanged
  branch being updated shared variables, or values computed from them in the
  call) into :class:`LazyStep`, an op that holds the nodes feeding only the
  new values as an inner graph, runs it only when the step happens, writes the
  results into the state buffers themselves (the inner graph is compiled with
  the states as mutable inputs, so the rule runs in place) and fills the
  states whose new value is zeros. The rewrite runs before elementwise
  fusion, so no part of the rule is fused into the accumulation's loops (and
  run on every call). C modes: the op's thunk calls the inner graph compiled
  by PyTensor's Numba backend (its elementwise loops are the faster ones; C
  when numba is missing), and a small C module, built once per compile
  directory, runs the calls that do not step inside PyTensor's C VM;
  Numba: the inner function sits behind an ``if`` in the compiled code
  (:func:`register_numba_lazy_step`). JAX and PyTorch keep the ``IfElse``.

All are registered by :func:`lasagne_accum.backends.install` when the library
is imported (the Numba implementations once PyTensor loads its Numba dispatch).
Each rewrite can be left out by name, to compare:
``get_mode("NUMBA").excluding("lasagne_accum_numba_gemm",
"lasagne_accum_gemm_reset", "lasagne_accum_lazy_step_numba")``,
``get_mode("CVM").excluding("lasagne_accum_gemm_reset",
"lasagne_accum_lazy_step_c")``.
"""

import hashlib
import pathlib

__all__ = ["register_numba_gemm_rewrite", "register_gemm_reset_rewrite", "register_numba_gemm",
           "register_lazy_step_rewrite", "register_numba_lazy_step", "LazyStep"]

_registered: set[str] = set()
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

    Examples
    --------
    Importing :mod:`lasagne_accum` registers it; an accumulation then runs as
    one in-place ``Gemm`` under Numba:

    >>> import numpy as np, pytensor, pytensor.tensor as pt
    >>> from pytensor.compile.mode import NUMBA
    >>> import lasagne_accum
    >>> acc = pytensor.shared(np.zeros((2, 2)), name="acc")
    >>> x = pt.matrix("x")
    >>> f = pytensor.function([x], [], updates={acc: acc + x.T @ x}, mode=NUMBA)
    >>> [str(n.op) for n in f.maker.fgraph.toposort() if "Gemm" in str(n.op)]
    ['Gemm{inplace}']
    >>> _ = f(np.ones((3, 2))); _ = f(np.ones((3, 2))); acc.get_value()
    array([[6., 6.],
           [6., 6.]])
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


def _is_scalar_zero(v):
    """``v`` is a scalar constant 0 (after PyTensor's constant folding of casts and fills)."""
    import pytensor.tensor as pt
    from pytensor.tensor.exceptions import NotScalarConstantError

    try:
        return bool(pt.get_underlying_scalar_constant_value(v) == 0)
    except NotScalarConstantError:
        return False


# --------------------------------------------------------------------------
# rewrite: Gemm(select(fresh, 0, acc), ...) -> Gemm(acc, ..., beta=select(fresh, 0, beta))
# --------------------------------------------------------------------------
def _gemm_reset_rewrite():
    import numpy as np
    import pytensor.tensor as pt
    from pytensor.graph.rewriting.basic import node_rewriter
    from pytensor.scalar.basic import Switch
    from pytensor.tensor.blas import Gemm
    from pytensor.tensor.elemwise import Elemwise

    @node_rewriter([Gemm])
    def local_gemm_select_reset(fgraph, node):
        """``gemm(switch(c, 0, z), a, x, y, b)`` -> ``gemm(z, a, x, y, switch(c, 0, b))``."""
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
        if _is_scalar_zero(if_true) and if_false.type == z.type:
            kept, new_beta = if_false, pt.switch(flag, zero, beta)
        elif _is_scalar_zero(if_false) and if_true.type == z.type:
            kept, new_beta = if_true, pt.switch(flag, beta, zero)
        else:
            return None
        return [node.op(kept, alpha, x, y, new_beta)]

    return local_gemm_select_reset


def register_gemm_reset_rewrite():
    """Fold a select-to-zero of Gemm's accumulator into its ``beta`` (idempotent).

    The single-function form resets its buffers lazily with
    ``select(fresh, 0, acc) + dot(x, y)`` (a select, so that a NaN left in
    the buffer is dropped, where ``0 * acc`` would keep it). Once that sum is
    a ``Gemm``, the select is a parameter-sized pass and array per call; this
    rewrite makes it ``gemm(acc, alpha, x, y, select(fresh, 0, beta))``, which
    runs in place on the buffer. Exact, NaN included: with ``beta = 0`` BLAS
    gemm does not read its output's old values (the reference BLAS contract,
    "when BETA is supplied as zero then C need not be set on input", which
    OpenBLAS and scipy's BLAS keep: ``tests/test_fast_ops.py`` checks it), and
    so do ``Gemm``'s Python and Numba code paths. Registered for the C and
    Numba backends (``fast_run``, ``numba``), after the Gemm rewrites.

    Examples
    --------
    >>> import numpy as np, pytensor, pytensor.tensor as pt
    >>> from pytensor.compile.mode import CVM
    >>> import lasagne_accum  # registers the rewrite
    >>> acc = pytensor.shared(np.full((2, 2), np.nan), name="acc")
    >>> x, fresh = pt.matrix("x"), pt.scalar("fresh", dtype="bool")
    >>> new = pt.switch(fresh, 0.0, acc) + x.T @ x
    >>> f = pytensor.function([x, fresh], [], updates={acc: new}, mode=CVM)
    >>> [str(n.op) for n in f.maker.fgraph.toposort() if "Gemm" in str(n.op)]
    ['Gemm{inplace}']
    >>> _ = f(np.ones((3, 2)), True); acc.get_value()    # a reset: the NaN is dropped
    array([[3., 3.],
           [3., 3.]])
    >>> _ = f(np.ones((3, 2)), False); acc.get_value()   # then it accumulates
    array([[6., 6.],
           [6., 6.]])
    """
    if "gemm-reset" in _registered:
        return
    from pytensor.compile.mode import optdb
    from pytensor.graph.rewriting.basic import dfs_rewriter

    optdb.register("lasagne_accum_gemm_reset", dfs_rewriter(_gemm_reset_rewrite()),
                   "fast_run", "numba", position=1.72)
    _registered.add("gemm-reset")


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
    """Give PyTensor's ``Gemm`` a Numba implementation through BLAS (idempotent; imports numba).

    ``gemm(z, a, x, y, b) = b * z + a * x @ y`` (``z`` not read when
    ``b == 0``, as BLAS); the in-place ``Gemm`` writes into ``z``'s buffer.
    Inputs of any layout: a non-contiguous ``z`` is computed aside and copied
    in.

    Examples
    --------
    >>> import numpy as np, pytensor, pytensor.tensor as pt
    >>> from pytensor.compile.mode import NUMBA
    >>> from pytensor.tensor.blas import gemm_no_inplace
    >>> import lasagne_accum  # registers it once PyTensor loads its Numba backend
    >>> z, x, y = pt.matrix("z"), pt.matrix("x"), pt.matrix("y")
    >>> a, b = pt.scalar("a"), pt.scalar("b")
    >>> f = pytensor.function([z, a, x, y, b], gemm_no_inplace(z, a, x, y, b), mode=NUMBA)
    >>> f(np.ones((2, 2)), 2.0, np.eye(2), np.full((2, 2), 3.0), 0.5)
    array([[6.5, 6.5],
           [6.5, 6.5]])
    """
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

    @numba_basic.numba_njit
    def _gemm_aside(z, a, x, y, b):
        """``b * z + a * x @ y`` in a new array; z is not read when b == 0 (as BLAS)."""
        if b == 0:
            return np.asarray(a * _dot(x, y) + np.zeros_like(z))
        return np.asarray(b * z + a * _dot(x, y))

    @register_funcify_and_cache_key(Gemm)
    def numba_funcify_Gemm(op, node, **kwargs):
        dtype = node.outputs[0].type.dtype
        inplace = bool(op.inplace)
        if dtype not in ("float32", "float64"):
            @numba_basic.numba_njit
            def gemm_generic(z, a, x, y, b):
                return _gemm_aside(z, a.item(), x, y, b.item()).astype(z.dtype)

            return gemm_generic, f"lasagne_accum-gemm-generic-{dtype}-{_SOURCE_KEY}"
        run = gemm_into(dtype)

        if inplace:
            @numba_basic.numba_njit
            def gemm(z, a, x, y, b):
                if x.shape[1] != y.shape[0] or z.shape[0] != x.shape[0] or \
                        z.shape[1] != y.shape[1]:
                    return _gemm_aside(z, a.item(), x, y, b.item())
                run(z, a.item(), x, y, b.item())
                return z
        else:
            @numba_basic.numba_njit
            def gemm(z, a, x, y, b):
                if x.shape[1] != y.shape[0] or z.shape[0] != x.shape[0] or \
                        z.shape[1] != y.shape[1]:
                    return _gemm_aside(z, a.item(), x, y, b.item())
                out = z.copy()
                run(out, a.item(), x, y, b.item())
                return out

        return gemm, f"lasagne_accum-gemm-{dtype}-{inplace}-{_SOURCE_KEY}"

    _registered.add("numba-gemm")


# --------------------------------------------------------------------------
# the lazy step's non-stepping calls in C, for PyTensor's C VM
# --------------------------------------------------------------------------
# PyTensor's C VM calls a thunk's ``cthunk`` capsule directly (pointer: a
# function ``int f(void *data)``, context: ``data``) instead of the Python
# thunk; when ``f`` returns non-zero it raises the exception stored in the
# list [type, value, traceback] that ``data`` points to first. The capsule
# made here hands each state's array on to its output (unless the output
# already holds it) when the condition does not hold, and calls the Python
# `step` otherwise.
_HAND_ON_C = r"""
#include <Python.h>

typedef struct {
    PyObject *error;   /* [type, value, traceback]: read by the C VM; first member */
    PyObject *cond;    /* the condition's storage cell (a list of one item) */
    PyObject *step;    /* callable: the stepping call */
    Py_ssize_t n;
    PyObject **outs;   /* n output cells */
    PyObject **states; /* n state cells */
    PyObject *keep;    /* a tuple referencing every object above */
} HandOn;

static int hand_on(void *data) {
    HandOn *h = (HandOn *)data;
    int step = PyObject_IsTrue(PyList_GET_ITEM(h->cond, 0));
    if (step > 0) {
        PyObject *r = PyObject_CallNoArgs(h->step);
        if (r == NULL)
            step = -1;
        Py_XDECREF(r);
    } else if (step == 0) {
        for (Py_ssize_t i = 0; i < h->n; ++i) {
            PyObject *state = PyList_GET_ITEM(h->states[i], 0);
            PyObject *old = PyList_GET_ITEM(h->outs[i], 0);
            if (old != state) {
                Py_INCREF(state);
                PyList_SET_ITEM(h->outs[i], 0, state);
                Py_XDECREF(old);
            }
        }
    }
    if (step >= 0)
        return 0;
    PyObject *type, *value, *trace;
    PyErr_Fetch(&type, &value, &trace);
    PyErr_NormalizeException(&type, &value, &trace);
    if (type == NULL) {
        type = PyExc_SystemError;
        Py_INCREF(type);
    }
    if (value == NULL) {
        value = Py_None;
        Py_INCREF(value);
    }
    if (trace == NULL) {
        trace = Py_None;
        Py_INCREF(trace);
    }
    PyList_SetItem(h->error, 0, type);
    PyList_SetItem(h->error, 1, value);
    PyList_SetItem(h->error, 2, trace);
    return 1;
}

static void release(PyObject *capsule) {
    HandOn *h = (HandOn *)PyCapsule_GetContext(capsule);
    if (h == NULL)
        return;
    PyMem_Free(h->outs);
    Py_XDECREF(h->keep);
    PyMem_Free(h);
}

static int cells(PyObject *list) {
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(list); ++i) {
        PyObject *c = PyList_GET_ITEM(list, i);
        if (!PyList_Check(c) || PyList_GET_SIZE(c) != 1) {
            PyErr_SetString(PyExc_TypeError, "a storage cell is a list of one item");
            return -1;
        }
    }
    return 0;
}

static PyObject *make(PyObject *self, PyObject *args) {
    PyObject *error, *cond, *step, *outs, *states;
    if (!PyArg_ParseTuple(args, "O!O!OO!O!", &PyList_Type, &error, &PyList_Type, &cond,
                          &step, &PyList_Type, &outs, &PyList_Type, &states))
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(outs);
    if (PyList_GET_SIZE(error) != 3 || PyList_GET_SIZE(cond) != 1 || !PyCallable_Check(step)
            || PyList_GET_SIZE(states) != n) {
        PyErr_SetString(PyExc_ValueError,
                        "make(error: a list of 3, cond: a cell, step: a callable, "
                        "outs: cells, states: as many cells)");
        return NULL;
    }
    if (cells(outs) || cells(states))
        return NULL;
    HandOn *h = (HandOn *)PyMem_Calloc(1, sizeof(HandOn));
    if (h == NULL)
        return PyErr_NoMemory();
    /* the cells stay the same for the function's life; their items change */
    h->outs = (PyObject **)PyMem_Calloc(2 * n + 1, sizeof(PyObject *));
    h->keep = Py_BuildValue("(OOOOO)", error, cond, step, outs, states);
    PyObject *capsule = NULL;
    if (h->outs != NULL && h->keep != NULL)
        capsule = PyCapsule_New((void *)hand_on, NULL, release);
    if (capsule == NULL || PyCapsule_SetContext(capsule, h) != 0) {
        Py_XDECREF(capsule); /* no context yet: release() frees nothing */
        PyMem_Free(h->outs);
        Py_XDECREF(h->keep);
        PyMem_Free(h);
        return PyErr_Occurred() ? NULL : PyErr_NoMemory();
    }
    h->states = h->outs + n;
    for (Py_ssize_t i = 0; i < n; ++i) {
        h->outs[i] = PyList_GET_ITEM(outs, i);
        h->states[i] = PyList_GET_ITEM(states, i);
    }
    h->error = error;
    h->cond = cond;
    h->step = step;
    h->n = n;
    return capsule;
}

static PyMethodDef methods[] = {
    {"make", make, METH_VARARGS,
     "make(error, cond, step, outs, states): a capsule for PyTensor's C VM"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "MODULE_NAME", NULL, -1, methods};

PyMODINIT_FUNC PyInit_MODULE_NAME(void) { return PyModule_Create(&module); }
"""

_hand_on: list = []  # the module (or None), once looked for


def _hand_on_module():
    """The compiled :data:`_HAND_ON_C`, or None when it cannot be built here.

    Built once per PyTensor compile directory (under PyTensor's compile lock,
    as PyTensor builds its own C VM) and named by the source's hash, so an
    edit builds afresh. Where it cannot be built (no compiler, a read-only
    compile directory), :class:`LazyStep` keeps its Python thunk, with a
    warning.
    """
    if not _hand_on:
        import logging
        import sys

        module = None
        try:
            from pytensor.compile.compilelock import lock_ctx
            from pytensor.configdefaults import config
            from pytensor.link.c.cmodule import GCC_compiler, dlimport

            if config.cxx:
                args = GCC_compiler.compile_args()
                # the flags name the CPU: a compile directory shared by machines keeps one each
                key = hashlib.sha256(" ".join([_HAND_ON_C, sys.version, *args]).encode())
                key = key.hexdigest()[:16]
                name = f"lasagne_accum_lazy_step_{key}"
                location = pathlib.Path(config.compiledir) / name

                done = location / "complete"  # written once the module is whole

                def built():
                    return done.exists() and sorted(
                        p for p in location.glob(f"{name}.*") if p.suffix in (".so", ".pyd", ".dll"))

                if not built():
                    with lock_ctx():
                        if not built():
                            location.mkdir(parents=True, exist_ok=True)
                            GCC_compiler.compile_str(
                                name, _HAND_ON_C.replace("MODULE_NAME", name),
                                location=str(location), preargs=args)
                            done.touch()
                module = dlimport(str(built()[0]))
        except Exception as err:  # no compiler, a read-only compile directory, ...
            logging.getLogger(__name__).warning(
                "LazyStep runs its non-stepping calls in Python: its C part did not build (%s)",
                err)
        _hand_on.append(module)
    return _hand_on[0]


# --------------------------------------------------------------------------
# lazy, in-place step: IfElse(keep, states, new values) -> LazyStep
# --------------------------------------------------------------------------
def _make_lazy_step_class():
    import numpy as np
    from pytensor.graph.basic import Apply
    from pytensor.graph.op import Op

    class LazyStep(Op):
        """Run an inner graph only when a condition holds, writing into the states.

        ``LazyStep(cond, *states, *others)`` returns the states. When `cond`
        holds, the inner graph computes ``new_i = f_i(states, others)`` and
        each state's buffer is overwritten with ``new_i`` (the inner graph may
        compute it there directly: the states not in `zeros` are mutable
        inputs to it), then the `zeros` states' buffers are filled with
        zeros; otherwise nothing runs and the states come back unchanged.
        Output ``i`` is state ``i``'s buffer (``destroy_map``), so neither case
        copies.

        Built by the ``lasagne_accum_lazy_step`` rewrites from PyTensor's
        ``ifelse(keep, states, new_values)``, where the states are updated
        shared variables or values computed from them in the same call (the
        single-function form's gradient buffers, zeroed by the stepping call);
        JAX and PyTorch keep the ``IfElse``.

        Parameters
        ----------
        fgraph : FunctionGraph
            The inner graph: inputs are the states, then the other values it
            reads; outputs are the new values of the states not in `zeros`, in
            the states' order.
        n_states : int
            How many of the inputs are states.
        zeros : tuple of int
            The states whose new value is zeros: filled after the inner graph
            has run (which reads them but does not write them).

        Examples
        --------
        >>> import numpy as np, pytensor, pytensor.tensor as pt
        >>> from pytensor.compile.mode import CVM
        >>> from pytensor.graph.fg import FunctionGraph
        >>> from lasagne_accum.fast_ops import LazyStep
        >>> s_in, g_in = pt.vector("s"), pt.vector("g")
        >>> op = LazyStep(FunctionGraph([s_in, g_in], [s_in - g_in], clone=False), 1)
        >>> state = pytensor.shared(np.ones(2), name="state")
        >>> cond, g = pt.scalar("cond", dtype="bool"), pt.vector("g")
        >>> f = pytensor.function([cond, g], [], updates={state: op(cond, state, g)},
        ...                       mode=CVM, accept_inplace=True)
        >>> _ = f(False, np.full(2, 0.25)); state.get_value()   # nothing runs
        array([1., 1.])
        >>> _ = f(True, np.full(2, 0.25)); state.get_value()
        array([0.75, 0.75])
        """

        __props__ = ()

        def __init__(self, fgraph, n_states, zeros=()):
            self.fgraph = fgraph
            self.n_states = n_states
            self.zeros = tuple(sorted(zeros))
            self.computed = tuple(i for i in range(n_states) if i not in self.zeros)
            self.destroy_map = {i: [1 + i] for i in range(n_states)}
            self._fn = None

        def __eq__(self, other):
            return self is other

        def __hash__(self):
            return id(self)

        def __str__(self):
            zeros = f", {len(self.zeros)} zeroed" if self.zeros else ""
            return f"LazyStep{{{self.n_states} states{zeros}}}"

        def make_node(self, cond, *inputs):
            states = inputs[:self.n_states]
            return Apply(self, [cond, *inputs], [s.type() for s in states])

        def inner_function(self):
            """The inner graph compiled for the C backend's thunk (states mutable).

            Compiled by PyTensor's Numba backend when numba imports: its fused
            elementwise loops run an update rule several times faster than the
            C backend's (what ``default_modes`` measured for the apply step);
            else by the C backend.
            """
            if self._fn is None:
                import importlib.util

                import pytensor
                from pytensor.compile.io import In, Out

                mode = "NUMBA" if importlib.util.find_spec("numba") else "CVM"
                fg = self.fgraph.clone()
                ins = [In(v, borrow=True, mutable=i in self.computed)
                       for i, v in enumerate(fg.inputs)]
                self._fn = pytensor.function(ins, [Out(o, borrow=True) for o in fg.outputs],
                                             mode=mode, accept_inplace=True,
                                             on_unused_input="ignore")
                self._fn.trust_input = True
            return self._fn

        def prepare_node(self, node, storage_map, compute_map, impl):
            if impl != "numba":  # compile now, with the outer function, not at the first step
                self.inner_function()

        def make_thunk(self, node, storage_map, compute_map, no_recycling, impl=None):
            """A thunk whose calls that do not step only hand each state's buffer on.

            PyTensor's generic Python thunk first gathers every input into a
            list and calls :meth:`perform` (6.6 µs per call on the MLP of
            ``benchmarks/single_function.py`` in C, where the op's code and
            data are cold, after the BLAS calls). The Python thunk here hands
            the buffers on itself; where the small C module :data:`_HAND_ON_C`
            builds (once per PyTensor compile directory), its ``cthunk``
            capsule lets PyTensor's C VM do it without entering Python:
            3.4-4.0 µs per call against 6.4-7.5 µs for the Python thunk (each
            node timed in place by PyTensor's profiler; three and six processes),
            and non-stepping call / accumulate step 1.038 against 1.045 (C,
            float32, means of 16 processes each, paired by build order; 12
            of the 16 pairs lower). Stepping calls run :meth:`perform`
            either way.
            """
            self.prepare_node(node, storage_map, compute_map, impl)
            ins = [storage_map[v] for v in node.inputs]
            outs = [storage_map[v] for v in node.outputs]
            cond, states = ins[0], ins[1:1 + self.n_states]
            handed = list(zip(outs, states))
            # PyTensor's own Python thunk takes compute_map=None too
            computed = [] if compute_map is None else [compute_map[v] for v in node.outputs]
            perform = self.perform

            def step():
                perform(node, [c[0] for c in ins], outs)
                for c in computed:
                    c[0] = True

            def thunk():
                if cond[0]:
                    step()
                else:
                    for out, state in handed:
                        out[0] = state[0]
                    for c in computed:
                        c[0] = True

            thunk.inputs, thunk.outputs = ins, outs
            thunk.perform, thunk.lazy = perform, False
            module = _hand_on_module()
            if module is not None:
                # PyTensor's C VM calls the capsule in place of `thunk`. The
                # capsule holds `step`, not `thunk` (which holds the capsule):
                # capsules take no part in garbage collection, so a cycle
                # through one would never be freed, nor the states with it
                thunk.cthunk = module.make([None, None, None], cond, step, outs, states)
            return thunk

        def perform(self, node, inputs, output_storage):
            cond, args = inputs[0], inputs[1:]
            states = args[:self.n_states]
            if cond:
                new = list(self.inner_function()(*args))
                address = [s.__array_interface__["data"][0] for s in states]
                # in place, the inner graph may have written state i's new value into
                # state j's buffer: take those values aside before any store
                for k, (i, v) in enumerate(zip(self.computed, new)):
                    at = v.__array_interface__["data"][0]
                    if at != address[i] and at in address:
                        new[k] = v.copy()
                for i, v in zip(self.computed, new):
                    if v.__array_interface__["data"][0] != address[i]:
                        np.copyto(states[i], v)
                for i in self.zeros:
                    states[i].fill(0)
            for out, s in zip(output_storage, states):
                out[0] = s

    return LazyStep


LazyStep = _make_lazy_step_class()


def _exclusive_subgraph(fgraph, ifelse_node, false_vals):
    """Nodes whose outputs feed only the IfElse's false branch (directly or not)."""
    from pytensor.graph.traversal import io_toposort

    n = ifelse_node.op.n_outs
    false_slots = set(range(1 + n, 1 + 2 * n))
    inner = set()
    for node in reversed(io_toposort(fgraph.inputs, false_vals)):
        if getattr(node.op, "destroy_map", None):
            continue
        ok = True
        for out in node.outputs:
            for client, idx in fgraph.clients[out]:
                if client in inner or (client is ifelse_node and idx in false_slots):
                    continue
                ok = False
                break
            if not ok:
                break
        if ok:
            inner.add(node)
    return inner


def _lazy_step_rewrite():
    import numpy as np
    import pytensor.tensor as pt
    from pytensor.graph.basic import Constant
    from pytensor.graph.fg import FunctionGraph, Output
    from pytensor.graph.replace import clone_replace
    from pytensor.graph.rewriting.basic import node_rewriter
    from pytensor.ifelse import IfElse
    from pytensor.tensor.basic import Alloc

    def is_zeros(v):
        """``v`` is a constant zero or an ``Alloc`` of one (``pt.zeros(shape)``)."""
        if isinstance(v, Constant):
            return bool(np.all(np.asarray(v.data) == 0))
        return v.owner is not None and isinstance(v.owner.op, Alloc) and _is_scalar_zero(
            v.owner.inputs[0])

    def may_overwrite(fgraph, state):
        """A shared variable's value, or a value computed in the call that no output shows."""
        if state in fgraph.inputs:
            return True
        return state.owner is not None and not any(
            isinstance(client.op, Output) for client, _ in fgraph.clients[state])

    @node_rewriter([IfElse], inplace=True)
    def local_ifelse_to_lazy_step(fgraph, node):
        """``ifelse(keep, states, new)`` on updated states -> ``LazyStep(not keep, ...)``."""
        n = node.op.n_outs
        cond, branches = node.inputs[0], node.inputs[1:]
        states, new_values = branches[:n], branches[n:]
        if len(set(states)) != n or not all(may_overwrite(fgraph, s) for s in states):
            return None
        if any(s.type.dtype != o.type.dtype or s.type.ndim != o.type.ndim
               for s, o in zip(states, node.outputs)):
            return None
        zeros = [i for i, v in enumerate(new_values) if is_zeros(v)]
        computed = [v for i, v in enumerate(new_values) if i not in zeros]
        inner = _exclusive_subgraph(fgraph, node, computed)
        # what the inner graph reads from outside: its nodes' inputs, and the new
        # values computed outside it (or a state itself)
        outer_inputs = list(states)
        for v in [v for nd in inner for v in nd.inputs] + computed:
            if v.owner not in inner and not isinstance(v, Constant) and v not in outer_inputs:
                outer_inputs.append(v)
        inner_inputs = [v.type() for v in outer_inputs]
        inner_outputs = clone_replace(computed, replace=dict(zip(outer_inputs, inner_inputs)))
        op = LazyStep(FunctionGraph(inner_inputs, inner_outputs, clone=False), n, zeros)
        step = pt.eq(cond, 0)
        outs = op(step, *outer_inputs)
        outs = outs if isinstance(outs, list | tuple) else [outs]
        return [o if o.type == old.type else old.type.filter_variable(o)
                for o, old in zip(outs, node.outputs)]

    return local_ifelse_to_lazy_step


def register_lazy_step_rewrite():
    """Turn the single-function form's ``ifelse`` into :class:`LazyStep` in C and Numba (idempotent).

    Registered twice: under ``cxx_only`` (C modes) and ``numba``; JAX and
    PyTorch leave both tags out and keep the ``IfElse`` (JAX's already
    costs nothing there: XLA selects without copying).

    Examples
    --------
    >>> import numpy as np, pytensor, pytensor.tensor as pt
    >>> from pytensor.compile.mode import CVM
    >>> import lasagne_accum  # registers the rewrite
    >>> w = pytensor.shared(np.zeros(2), name="w")
    >>> g = pt.vector("g")
    >>> upd = lasagne_accum.sgd([g], [w], learning_rate=1.0, average=2)
    >>> f = pytensor.function([g], [], updates=upd, mode=CVM)
    >>> sorted({type(n.op).__name__ for n in f.maker.fgraph.toposort()} & {"IfElse", "LazyStep"})
    ['LazyStep']
    >>> _ = f(np.ones(2)); w.get_value()          # no step on the first call
    array([0., 0.])
    >>> _ = f(np.full(2, 3.0)); w.get_value()     # the mean gradient, 2
    array([-2., -2.])
    """
    if "lazy-rewrite" in _registered:
        return
    from pytensor.compile.mode import optdb
    from pytensor.graph.rewriting.basic import dfs_rewriter

    rewrite = _lazy_step_rewrite()
    # before elementwise fusion (48-49): fused first, the bias rules' loops would also
    # compute the accumulation (needed every call) and so stay outside the op; the
    # in-place passes (50+) then see the op's destroy_map
    optdb.register("lasagne_accum_lazy_step_c", dfs_rewriter(rewrite), "fast_run", "cxx_only",
                   "inplace", position=47.5)
    optdb.register("lasagne_accum_lazy_step_numba", dfs_rewriter(rewrite), "numba",
                   position=47.5)
    _registered.add("lazy-rewrite")


def register_numba_lazy_step():
    """Numba implementation of :class:`LazyStep` (idempotent; imports numba).

    The inner graph is compiled by the Numba backend and called behind an
    ``if`` in the outer function's code; its results are stored into the
    states' buffers unless the inner graph wrote them there already.

    Examples
    --------
    >>> import numpy as np, pytensor, pytensor.tensor as pt
    >>> from pytensor.compile.mode import NUMBA
    >>> import lasagne_accum  # registers it once PyTensor loads its Numba backend
    >>> w = pytensor.shared(np.zeros(2), name="w")
    >>> g = pt.vector("g")
    >>> upd = lasagne_accum.sgd([g], [w], learning_rate=1.0, average=2)
    >>> f = pytensor.function([g], [], updates=upd, mode=NUMBA)
    >>> "LazyStep" in {type(n.op).__name__ for n in f.maker.fgraph.toposort()}
    True
    >>> _ = f(np.ones(2)); _ = f(np.full(2, 3.0)); w.get_value()
    array([-2., -2.])
    """
    if "numba-lazy" in _registered:
        return
    register_lazy_step_rewrite()
    from hashlib import sha256

    from pytensor.compile.aliasing import add_supervisor_to_fgraph, insert_deepcopy
    from pytensor.compile.io import In, Out
    from pytensor.compile.mode import NUMBA
    from pytensor.link.numba.cache import compile_numba_function_src
    from pytensor.link.numba.dispatch import basic as numba_basic
    from pytensor.link.numba.dispatch.basic import (
        numba_funcify_and_cache_key,
        register_funcify_and_cache_key,
    )

    @numba_basic.numba_njit
    def aside(value, own, addresses):
        at = value.ctypes.data
        if at != own.ctypes.data:
            for other in addresses:
                if other == at:
                    return value.copy()
        return value

    @numba_basic.numba_njit
    def store0(dst, src):
        if dst.ctypes.data != src.ctypes.data:
            dst[()] = src[()]

    @numba_basic.numba_njit
    def store(dst, src):
        if dst.ctypes.data != src.ctypes.data:
            dst[...] = src

    @register_funcify_and_cache_key(LazyStep)
    def numba_funcify_LazyStep(op, node=None, **kwargs):
        kwargs.pop("storage_map", None)
        fgraph = op.fgraph.clone()
        specs = [In(v, borrow=True, mutable=i in op.computed)
                 for i, v in enumerate(fgraph.inputs)]
        add_supervisor_to_fgraph(fgraph=fgraph, input_specs=specs, accept_inplace=True)
        NUMBA.optimizer(fgraph)
        insert_deepcopy(fgraph, wrapped_inputs=specs,
                        wrapped_outputs=[Out(o, borrow=True) for o in fgraph.outputs])
        inner, inner_key = numba_funcify_and_cache_key(
            fgraph, squeeze_output=False, fgraph_name="lazy_step_inner", **kwargs)
        n = op.n_states
        args = [f"a{i}" for i in range(len(fgraph.inputs))]
        # in place, the inner graph may have written state i's new value into state
        # j's buffer: take those values aside (aside) before any store; the zeroed
        # states' fills come last
        lines = ["    if cond:"]
        if op.computed:
            addresses = ", ".join(f"a{i}.ctypes.data" for i in range(n)) + ("," if n == 1 else "")
            lines += [f"        new = inner({', '.join(args)})",
                      f"        addresses = ({addresses})"]
            lines += [f"        n{i} = aside(new[{k}], a{i}, addresses)"
                      for k, i in enumerate(op.computed)]
            lines += [f"        store{'0' if fgraph.inputs[i].type.ndim == 0 else ''}(a{i}, n{i})"
                      for i in op.computed]
        lines += [f"        a{i}[{'()' if fgraph.inputs[i].type.ndim == 0 else '...'}] = 0"
                  for i in op.zeros]
        returns = ", ".join(args[:n]) + ("," if n == 1 else "")
        src = (f"def lazy_step(cond, {', '.join(args)}):\n" + "\n".join(lines) + "\n"
               f"    return {args[0] if n == 1 else returns}\n")
        fn = numba_basic.numba_njit(compile_numba_function_src(
            src, "lazy_step", {"inner": inner, "store": store, "store0": store0, "aside": aside}))
        key = None if inner_key is None else sha256(
            str(("lasagne_accum.LazyStep", n, op.zeros, inner_key, _SOURCE_KEY)).encode()).hexdigest()
        return fn, key

    _registered.add("numba-lazy")
