"""Build the compilation modes of :func:`lasagne_accum.mode` (see the package notes)."""

from __future__ import annotations

import weakref
from typing import Any

__all__ = ["build", "backend_of"]

_cache: dict[Any, tuple[Any, Any]] = {}


def backend_of(mode) -> str | None:
    """``"c"`` (the C and Python linkers), ``"numba"``, ``"jax"``, ``"pytorch"``, or None.

    None for any other Mode (``DebugMode``, another backend's linker): our
    rewrites and fixes are not made for it.
    """
    from pytensor.compile.mode import Mode
    from pytensor.link.basic import PerformLinker
    from pytensor.link.c.basic import CLinker, OpWiseCLinker
    from pytensor.link.jax.linker import JAXLinker
    from pytensor.link.numba.linker import NumbaLinker
    from pytensor.link.pytorch.linker import PytorchLinker
    from pytensor.link.vm import VMLinker

    if type(mode) is not Mode:
        return None
    kinds = ((NumbaLinker, "numba"), (JAXLinker, "jax"), (PytorchLinker, "pytorch"),
             ((VMLinker, CLinker, OpWiseCLinker, PerformLinker), "c"))
    for classes, kind in kinds:
        if isinstance(mode.linker, classes):
            return kind
    return None


def build(base: Any = "CVM") -> Any:
    """`base` (a mode name or a Mode) with our rewrites and backend fixes included.

    PyTensor's own `base` when the installed PyTensor is outside
    :data:`lasagne_accum._pytensor.SUPPORTED` (one warning), and for a Mode
    whose backend is none of C, Numba, JAX and PyTorch.
    """
    from pytensor.compile.mode import Mode, get_mode

    from . import supported

    base_mode = get_mode(base)
    if not isinstance(base_mode, Mode):
        raise TypeError(f"mode(): base must be a mode name or a pytensor Mode, got {base!r}")
    kind = backend_of(base_mode)
    if kind is None or not supported():
        return base_mode
    key = id(base_mode)
    if key in _cache and _cache[key][0]() is base_mode:
        return _cache[key][1]
    from . import TAGS, gemm, lazy_step, linkers, register_rewrites

    register_rewrites()
    if kind == "numba":
        gemm.register_numba()
        lazy_step.register_numba()
    _, optimizer = base_mode.get_linker_optimizer(base_mode.provided_linker,
                                                  base_mode.provided_optimizer)
    optimizer = optimizer.including(TAGS[kind])
    linker: Any
    if kind == "jax":
        linker = linkers.JAXLinker()
    elif kind == "pytorch":
        linker = linkers.PytorchLinker()
    else:
        linker = base_mode.linker.clone()
    built = Mode(linker=linker, optimizer=optimizer)
    for stale in [k for k, (ref, _) in _cache.items() if ref() is None]:
        del _cache[stale]
    _cache[key] = (weakref.ref(base_mode), built)
    return built
