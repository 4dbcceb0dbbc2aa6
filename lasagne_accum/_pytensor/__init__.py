"""The only code of lasagne_accum that touches PyTensor's internals.

Everything here is private: custom ops (:mod:`.lazy_step`, :mod:`.gemm`,
:mod:`.sum_squares`),
graph rewrites, and fixes to PyTensor's C, JAX and PyTorch backends
(:mod:`.literals`, and our linkers: :mod:`.jax_linker`, :mod:`.pytorch_linker`
and :mod:`.host_linker`, beside what they share in :mod:`.linkers`). None of
it is active unless a function is compiled with :func:`lasagne_accum.mode`,
which includes our rewrites by their tags (``lasagne_accum_c``,
``lasagne_accum_numba``, ...) and links with our JAX and PyTorch linkers; no
predefined PyTensor mode includes those tags, and importing the package
registers nothing.

The seam is tested against the PyTensor releases in :data:`SUPPORTED`.
Outside them :func:`supported` warns once and :func:`lasagne_accum.mode`
returns PyTensor's own mode: the same numbers, without our speed-ups and
backend fixes (the docs' backends page says which numbers differ there).
"""

from __future__ import annotations

import functools
import hashlib
import pathlib
import re
import warnings

__all__ = ["SUPPORTED", "supported", "version_tuple", "register_rewrites", "TAGS",
           "source_key", "FIXED_UPSTREAM", "fixed_upstream"]

#: The PyTensor releases this seam is tested with: ``low <= version < high``.
#: CI runs the suite on both ends: 3.0.7 (the newest release for Python 3.11)
#: and the newest 3.3.x (Python 3.12+).
SUPPORTED = ("3.0.7", "3.4")

#: Our backend fixes that PyTensor has made unnecessary, and the first release
#: tested without the bug (``tests/test_upstream_*.py`` check both sides).
FIXED_UPSTREAM = {
    "jax_arange": "3.3",   # constant bounds no longer reach jnp.arange as int8
}

#: The optimizer tag of our rewrites for each kind of backend.
TAGS = {
    "c": "lasagne_accum_c",
    "numba": "lasagne_accum_numba",
    "jax": "lasagne_accum_jax",
    "pytorch": "lasagne_accum_pytorch",
}

_checked: dict[str, bool] = {}
_registered: list[bool] = []


@functools.cache
def source_key(path: str) -> str:
    """A hash of the file at `path`, for the key of Numba code generated there.

    Numba's on-disk cache is keyed by what a dispatcher says: with the
    module's hash in the key, every edit of the generated code compiles afresh.
    """
    return hashlib.sha256(pathlib.Path(path).read_bytes()).hexdigest()[:16]


def version_tuple(version: str) -> tuple[int, ...]:
    """The leading numbers of a version string: ``"3.0.7.dev1"`` -> ``(3, 0, 7)``.

    Examples
    --------
    >>> version_tuple("3.0.7")
    (3, 0, 7)
    >>> version_tuple("3.1.0rc1+g123")
    (3, 1, 0)
    """
    match = re.match(r"\d+(\.\d+)*", version.strip())
    if match is None:
        return ()
    return tuple(int(part) for part in match.group(0).split("."))


def fixed_upstream(fix: str) -> bool:
    """Whether the installed PyTensor has fixed the bug behind `fix` (a key of :data:`FIXED_UPSTREAM`)."""
    import pytensor

    return version_tuple(str(pytensor.__version__)) >= version_tuple(FIXED_UPSTREAM[fix])


def supported() -> bool:
    """True when the installed PyTensor is in :data:`SUPPORTED`; else warn once.

    Read at the first call (the first :func:`lasagne_accum.mode`), not at
    import.
    """
    import pytensor

    version = str(getattr(pytensor, "__version__", "0"))
    if version not in _checked:
        low, high = (version_tuple(v) for v in SUPPORTED)
        ok = low <= version_tuple(version) < high
        _checked[version] = ok
        if not ok:
            warnings.warn(
                f"lasagne_accum is tested with PyTensor >={SUPPORTED[0]},<{SUPPORTED[1]}; "
                f"found {version}. lasagne_accum.mode() gives PyTensor's own modes: the "
                "same numbers, without the library's in-place fast paths and backend fixes.",
                RuntimeWarning,
                stacklevel=4,   # supported() <- build() <- lasagne_accum.mode() <- the caller
            )
    return _checked[version]


def register_rewrites() -> None:
    """Register our rewrites in PyTensor's ``optdb``, under our tags only (once).

    Registering under a tag that no predefined mode includes leaves every
    other function's compilation as it was (PyMC registers its rewrites the
    same way); only modes made by :func:`lasagne_accum.mode` include them.
    """
    if _registered:
        return
    from pytensor.compile.mode import optdb

    from . import gemm, gemm_squares, lazy_step, literals, sum_squares

    c, numba = TAGS["c"], TAGS["numba"]
    # before PyTensor rewrites anything (canonicalize, 1): the tagged sums as built
    optdb.register("lasagne_accum_sum_squares", sum_squares.sum_squares(), c, numba,
                   position=0.7)
    # before PyTensor inlines OpFromGraph nodes (-0.01): our window step stays one node
    optdb.register("lasagne_accum_lazy_step", lazy_step.to_lazy_step(), c, numba,
                   position=-0.02)
    # where PyTensor's own BLAS rewrites run for the C backend (BlasOpt, 1.7)
    optdb.register("lasagne_accum_numba_gemm", gemm.numba_gemm_rewrites(), numba,
                   position=1.71)
    optdb.register("lasagne_accum_gemm_reset", gemm.gemm_reset(), c, numba, position=1.72)
    # the tagged Gram sums: placeholders before PyTensor rewrites the graph, fused with the
    # product's Gemm once its BLAS rewrite has made it, written in place with the others
    optdb.register("lasagne_accum_product_squares", gemm_squares.product_squares(), c, numba,
                   position=0.71)
    optdb.register("lasagne_accum_gemm_squares", gemm_squares.gemm_squares(), c, numba,
                   position=1.73)
    optdb.register("lasagne_accum_gemm_squares_inplace", gemm_squares.inplace(), c, numba,
                   position=49.61)
    # after elemwise fusion (49), which makes the C code's scalar constants
    optdb.register("lasagne_accum_exact_literals", literals.exact_literals(), c,
                   position=49.2)
    # after the destroy handler (49.5), before PyTensor's in-place passes (50.2+)
    optdb.register("lasagne_accum_lazy_step_inplace", lazy_step.inplace(), c, numba,
                   position=49.6)
    # after every in-place pass: Gemm gets our Numba implementation
    optdb.register("lasagne_accum_numba_blas", gemm.to_numba_gemm(), numba, position=99)
    _registered.append(True)
