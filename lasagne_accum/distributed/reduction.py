"""A sync round's reduction: the weighted mean (or the sum) of the workers' gradients.

The arithmetic is fixed, so that a round's result does not depend on how it
is computed: in float64, the workers in the order given, starting from 0,

* mean: ``acc = 0; acc = acc + float64(g_k) * w_k for each k; result = acc / total``;
* sum: ``acc = 0; acc = acc + float64(g_k) for each k; result = acc``;

then rounded once to the parameter's dtype. :func:`reduce_grads` runs it as one
compiled loop per worker and one to finish (Numba, where it is installed, for
float32 and float64 parameters), else with numpy (a few more passes over
the arrays); both give the same bits.
"""

import numpy as np

__all__ = ["reduce_grads", "reduce_grads_numpy"]

_kernels = None


def _compiled():
    """The Numba kernels, compiled at first use; False where Numba is not installed."""
    global _kernels
    if _kernels is None:
        try:
            import numba
        except ImportError:
            _kernels = False
            return _kernels

        @numba.njit(nogil=True, cache=True)
        def add_weighted(acc, g, w, first):   # acc + float64(g) * w (acc = 0 when first)
            if first:
                for i in range(acc.size):
                    acc[i] = 0.0 + np.float64(g[i]) * w
            else:
                for i in range(acc.size):
                    acc[i] = acc[i] + np.float64(g[i]) * w

        @numba.njit(nogil=True, cache=True)
        def add(acc, g, first):               # acc + float64(g) (acc = 0 when first)
            if first:
                for i in range(acc.size):
                    acc[i] = 0.0 + np.float64(g[i])
            else:
                for i in range(acc.size):
                    acc[i] = acc[i] + np.float64(g[i])

        @numba.njit(nogil=True, cache=True)
        def finish(acc, total, out):          # acc / total, rounded to out's dtype
            for i in range(acc.size):
                out[i] = acc[i] / total

        _kernels = (add_weighted, add, finish)
    return _kernels


def reduce_grads_numpy(arrays, weights, total, dtype, mean=True):
    """:func:`reduce_grads` with numpy only (the reference the compiled loops must equal)."""
    acc = np.zeros(np.shape(arrays[0]), np.float64)
    term = np.empty_like(acc)
    for g, w in zip(arrays, weights):
        if mean:
            np.multiply(g, w, out=term, dtype=np.float64)
            acc += term
        else:
            acc += g
    if mean:
        acc /= total
    return acc.astype(dtype)


def reduce_grads(arrays, weights, total, dtype, mean=True, scratch=None):
    """The reduced gradient of one parameter (see the module's notes).

    Parameters
    ----------
    arrays : list of ndarray
        Each worker's gradient, in the round's order, all of one shape.
    weights : list of float
        Each worker's weight (used when `mean`).
    total : float
        The sum of the weights (used when `mean`).
    dtype : str
        The parameter's dtype: the result's.
    mean : bool
        The weighted mean; False: the sum.
    scratch : dict, optional
        Kept by the caller between calls for this parameter: the compiled
        loops write the float64 accumulator and the result into arrays kept
        there (made at the first call) instead of new ones, whose pages the
        kernel would have to supply again at every round. The result is then
        valid until the next call with the same `scratch`.
    """
    kernels = _compiled() if str(dtype) in ("float32", "float64") else False
    if not kernels or not all(isinstance(g, np.ndarray) and g.flags.c_contiguous
                              and g.dtype == np.dtype(dtype) for g in arrays):
        return reduce_grads_numpy(arrays, weights, total, dtype, mean)
    add_weighted, add, finish = kernels
    shape = np.shape(arrays[0])
    scratch = {} if scratch is None else scratch
    if scratch.get("shape") != (shape, str(dtype)):
        scratch.update(shape=(shape, str(dtype)), acc=np.empty(shape, np.float64),
                       out=np.empty(shape, dtype))
    acc, out = scratch["acc"].reshape(-1), scratch["out"]
    for k, (g, w) in enumerate(zip(arrays, weights)):
        if mean:
            add_weighted(acc, g.reshape(-1), float(w), k == 0)
        else:
            add(acc, g.reshape(-1), k == 0)
    finish(acc, float(total) if mean else 1.0, out.reshape(-1))
    return out


def warm_up(dtypes):
    """Compile the loops for these parameter dtypes now (not in a round's critical path)."""
    for dtype in set(map(str, dtypes)):
        g = np.zeros(2, dtype)
        reduce_grads([g, g], [1.0, 1.0], 2.0, dtype)
        reduce_grads([g], [1.0], 1.0, dtype, mean=False)
