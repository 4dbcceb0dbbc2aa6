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


def build(base: Any = "CVM", device: Any = None, compile: bool | None = None) -> Any:
    """`base` (a mode name or a Mode) with our rewrites and backend fixes included.

    `device` and `compile` are for a PyTorch `base` (see :func:`lasagne_accum.mode`).
    PyTensor's own `base` when the installed PyTensor is outside
    :data:`lasagne_accum._pytensor.SUPPORTED` (one warning), and for a Mode
    whose backend is none of C, Numba, JAX and PyTorch.
    """
    from pytensor.compile.mode import Mode, get_mode

    from . import supported
    from .host_linker import host_linker
    from .jax_linker import JAXLinker
    from .pytorch_linker import PytorchLinker

    base_mode = get_mode(base)
    if not isinstance(base_mode, Mode):
        raise TypeError(f"mode(): base must be a mode name or a pytensor Mode, got {base!r}")
    kind = backend_of(base_mode)
    if kind is None:
        if device is not None or compile is not None:
            raise ValueError("mode(): device= and compile= apply to the PYTORCH backend only")
        return base_mode
    if kind != "pytorch" and (device is not None or compile is not None):
        given = "device" if device is not None else "compile"
        where = ("JAX puts arrays on its default device (jax.default_device, or the "
                 "JAX_PLATFORMS environment variable)" if kind == "jax" else
                 "the C and Numba backends run on the CPU")
        raise ValueError(f"mode(): {given}= applies to the PYTORCH backend only; {where}")
    if kind == "pytorch":
        from .values import torch_device

        ours = base_mode.linker if isinstance(base_mode.linker, PytorchLinker) else None
        if ours is not None:   # a mode of ours again: its device and compile setting
            device = ours.device if device is None else device
            compile = ours.compile if compile is None else compile
        device = torch_device(device)
        if compile is None:
            compile = device.type not in ("cpu", "meta")
    if not supported():
        return base_mode
    key = (id(base_mode), str(device), compile)
    if key in _cache and _cache[key][0]() is base_mode:
        return _cache[key][1]
    from . import TAGS, gemm, gemm_squares, lazy_step, register_rewrites

    register_rewrites()
    if kind == "numba":
        gemm.register_numba()
        gemm_squares.register_numba()
        lazy_step.register_numba()
    _, optimizer = base_mode.get_linker_optimizer(base_mode.provided_linker,
                                                  base_mode.provided_optimizer)
    optimizer = optimizer.including(TAGS[kind])
    linker: Any
    if kind == "jax":
        linker = JAXLinker()
    elif kind == "pytorch":
        linker = PytorchLinker(device=device, compile=compile)
    else:
        linker = host_linker(base_mode.linker, kind)
    built = Mode(linker=linker, optimizer=optimizer)
    for stale in [k for k, (ref, _) in _cache.items() if ref() is None]:
        del _cache[stale]
    _cache[key] = (weakref.ref(base_mode), built)
    return built
