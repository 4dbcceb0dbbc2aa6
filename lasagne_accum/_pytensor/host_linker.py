"""Our C, Numba and Python linkers: PyTensor's, reading values left by JAX or PyTorch.

A shared variable last updated by a function of our JAX or PyTorch mode holds
a JAX array or a torch tensor, which PyTensor's C and Numba backends cannot
read (the reproducer on plain PyTensor is in ``tests/test_upstream_c.py``,
beside the one of the C backend's inexact float32 literals, which
:mod:`.literals` fixes): it is copied to the host first (:class:`HostCall`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .linkers import _label
from .values import to_host

__all__ = ["HostCall", "host_linker"]


# reproducer: test_a_jax_value_cannot_be_read_by_c
class HostCall:
    """A C or Numba function's VM, given host copies of device values first.

    A shared variable last updated by a JAX or PyTorch function holds a JAX
    array or a torch tensor, which the C and Numba backends cannot read: it is
    copied to the host (and stays there) before the VM runs. Every attribute
    is the VM's own (:class:`pytensor.compile.executor.Function` reads them).
    """

    __slots__ = ("_vm", "_cells", "_backend")

    def __init__(self, vm, cells, backend):
        object.__setattr__(self, "_vm", vm)
        object.__setattr__(self, "_cells", tuple(cells))
        object.__setattr__(self, "_backend", backend)

    def __call__(self, *args, **kwargs):
        for cell, name in self._cells:
            value = cell[0]
            if type(value) is not np.ndarray and type(value).__module__.startswith(
                    ("jax", "torch")):
                cell[0] = to_host(value, name, self._backend)
        return self._vm(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._vm, name)

    def __setattr__(self, name, value):
        setattr(self._vm, name, value)


class _HostInputs:
    """Mixin of our C and Numba linkers: the thunk is wrapped in :class:`HostCall`."""

    _backend = "c"

    def make_thunk(self, *args, **kwargs):
        from pytensor.compile.sharedvalue import SharedVariable

        fn, inputs, outputs, *rest = super().make_thunk(*args, **kwargs)
        cells = [(container.storage, _label(var))
                 for var, container in zip(self.fgraph.inputs, inputs)
                 if isinstance(var, SharedVariable)]
        if cells:
            fn = HostCall(fn, cells, self._backend)
        return (fn, inputs, outputs, *rest)


_host_classes: dict[type, type] = {}


def host_linker(linker, backend: str):
    """A clone of `linker` (a C, Numba or Python linker) that reads device values.

    Its class is a subclass of the linker's own with :class:`_HostInputs`
    first (its attributes are the linker's), so ``accept``, which makes a new
    linker of ``type(self)`` for a second graph, keeps it.
    """
    cls = type(linker)
    if isinstance(linker, _HostInputs):   # one of ours already
        return linker.clone()  # type: ignore[attr-defined]
    if cls not in _host_classes:
        _host_classes[cls] = type(f"Host{cls.__name__}", (_HostInputs, cls),
                                  {"_backend": backend, "__module__": __name__})
    new: Any = object.__new__(_host_classes[cls])
    new.__dict__.update(linker.clone().__dict__)
    return new
