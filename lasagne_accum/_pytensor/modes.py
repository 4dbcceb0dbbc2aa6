"""Build the compilation modes of :func:`lasagne_accum.mode` (see the package notes)."""

from __future__ import annotations

from typing import Any

__all__ = ["build", "backend_of"]

_cache: dict[Any, tuple[Any, Any]] = {}


def backend_of(mode) -> str:
    """``"numba"``, ``"jax"``, ``"pytorch"`` or ``"c"`` (the C and Python linkers) for a Mode."""
    from pytensor.link.jax.linker import JAXLinker
    from pytensor.link.numba.linker import NumbaLinker
    from pytensor.link.pytorch.linker import PytorchLinker

    linker = mode.linker
    if isinstance(linker, NumbaLinker):
        return "numba"
    if isinstance(linker, JAXLinker):
        return "jax"
    if isinstance(linker, PytorchLinker):
        return "pytorch"
    return "c"


def build(base: Any = "CVM") -> Any:
    """`base` (a mode name or a Mode) with our rewrites and backend fixes included.

    PyTensor's own `base` when the installed PyTensor is outside
    :data:`lasagne_accum._pytensor.SUPPORTED` (one warning).
    """
    from pytensor.compile.mode import Mode, get_mode

    from . import supported

    base_mode = get_mode(base)
    if not isinstance(base_mode, Mode):
        raise TypeError(f"mode(): base must be a mode name or a pytensor Mode, got {base!r}")
    if not supported():
        return base_mode
    key = id(base_mode)
    if key in _cache and _cache[key][0] is base_mode:
        return _cache[key][1]
    from . import TAGS, gemm, lazy_step, linkers, register_rewrites

    register_rewrites()
    kind = backend_of(base_mode)
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
    _cache[key] = (base_mode, built)
    return built
