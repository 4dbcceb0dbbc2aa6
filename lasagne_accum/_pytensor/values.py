"""Where a shared variable's value lives, and moving it between backends.

A shared variable's value is a numpy array under the C and Numba backends, a
JAX array after a call of a function compiled with ``lasagne_accum.mode("JAX")``
and a torch tensor after one compiled with ``lasagne_accum.mode("PYTORCH")``.
The functions our modes compile read whichever they find and convert it here,
through the host (a mode switch is rare; a copy is safe where a shared buffer
would let one backend write into another's memory). A value that cannot be
converted raises :class:`ValueError` naming the variable and both backends.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

__all__ = ["backend_of_value", "store_output", "to_host", "to_torch", "convert_error",
           "refcounts", "BASE_REFCOUNT", "torch_device", "BACKEND_NAMES"]

#: How the docs and error messages name each backend.
BACKEND_NAMES = {"c": "C", "numba": "NUMBA", "jax": "JAX", "pytorch": "PYTORCH",
                 "host": "a numpy array"}


def backend_of_value(value: Any) -> str:
    """``"jax"``, ``"pytorch"`` or ``"host"`` (numpy and Python values), by the value's type.

    Neither JAX nor torch is imported: a value of theirs carries its module.

    Examples
    --------
    >>> backend_of_value(np.zeros(2)), backend_of_value(1.5)
    ('host', 'host')
    """
    module = type(value).__module__ or ""
    if module.startswith(("jax", "jaxlib")):
        return "jax"
    if module.startswith("torch"):
        return "pytorch"
    return "host"


def store_output(variable: Any, value: np.ndarray) -> None:
    """Make `value`, an output of a function compiled from `variable`'s own update, its value.

    The same as ``variable.set_value(value, borrow=True)`` without the type's
    filter (it costs more than a small array's update) where `value` is a
    numpy array of the variable's dtype and rank, as the C and Numba backends'
    outputs are; anything else goes through ``set_value``.
    """
    vtype = variable.type
    if (type(value) is np.ndarray and value.dtype == getattr(vtype, "dtype", None)
            and value.ndim == getattr(vtype, "ndim", None)):
        variable.container.storage[0] = value
    else:
        variable.set_value(value, borrow=True)


def convert_error(name: str, value: Any, backend: str, exc: BaseException) -> ValueError:
    """The error for a value of `name` that a `backend` function cannot read."""
    held = BACKEND_NAMES[backend_of_value(value)]
    return ValueError(
        f"{name} holds a value of the {held} backend ({type(value).__name__}), which this "
        f"{BACKEND_NAMES[backend]} function could not convert ({exc}); set a numpy value "
        f"with {name}.set_value(...) first"
    )


def to_host(value: Any, name: str = "value", backend: str = "c") -> Any:
    """`value` as a numpy array: JAX arrays and torch tensors are copied to the host.

    Host values (numpy arrays, Python numbers) are returned as they are.

    Raises
    ------
    ValueError
        If the device value cannot be copied to the host (a deleted JAX
        array, a torch tensor on the ``meta`` device), naming `name`.

    Examples
    --------
    >>> to_host(np.arange(3))
    array([0, 1, 2])
    """
    kind = backend_of_value(value)
    if kind == "host":
        return value
    try:
        if kind == "pytorch":
            return value.detach().cpu().numpy().copy()
        return np.array(value)
    except Exception as exc:  # JAX and torch raise RuntimeError/ValueError/NotImplementedError
        raise convert_error(name, value, backend, exc) from None


def torch_device(device: Any) -> Any:
    """A ``torch.device`` that exists on this machine, for ``mode("PYTORCH", device=...)``.

    None gives CUDA when available, else the CPU.

    Raises
    ------
    ValueError
        If `device` is not a device name, or names a device this machine
        does not have (with the devices it has).
    """
    import torch

    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"mode(): device={device!r} is not a torch device ({exc})") from None
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ValueError(f"mode(): device={device!r}, but this machine has no CUDA "
                             "device (torch.cuda.is_available() is False); use 'cpu'")
        index = 0 if dev.index is None else dev.index
        if index >= count:
            raise ValueError(f"mode(): device={device!r}, but this machine has {count} CUDA "
                             f"device(s): cuda:0 to cuda:{count - 1}")
        return torch.device("cuda", index)
    if dev.type not in ("cpu", "meta"):
        try:
            torch.empty(0, device=dev)
        except Exception as exc:
            raise ValueError(f"mode(): device={device!r} is not available on this machine "
                             f"({exc})") from None
    return dev


def to_torch(value: Any, device: Any, name: str = "value") -> Any:
    """`value` as a torch tensor on `device`.

    A tensor already there is returned as it is; anything
    else is copied (never shared with numpy or JAX memory, so that writing
    into the tensor in place cannot change another backend's value).

    Raises
    ------
    ValueError
        If `value` cannot be converted, naming `name`.
    """
    import torch

    if isinstance(value, torch.Tensor):
        if value.device == device:
            return value
        return value.detach().to(device, copy=True)
    try:
        host = np.array(value) if backend_of_value(value) == "jax" else np.asarray(value)
        if not host.flags.writeable:
            host = host.copy()
        return torch.tensor(host, device=device)
    except Exception as exc:
        raise convert_error(name, value, "pytorch", exc) from None


def refcounts(args: tuple, indices: Any) -> list[int]:
    """``sys.getrefcount`` of ``args[i]`` for each index (see :data:`BASE_REFCOUNT`)."""
    return [sys.getrefcount(args[i]) for i in indices]


class _Probe:
    """Called like :class:`~lasagne_accum._pytensor.jax_linker.DonatingCall` (an object)."""

    def __call__(self, *args):
        return refcounts(args, (0,))[0]


#: What :func:`refcounts` reports, inside a callable object's ``__call__``, for a
#: value held by one storage cell only and passed the way PyTensor's JIT
#: linkers pass it (``fn(*(cell[0] for cell in cells))``): more means that
#: someone else holds it too.
def _base_refcount() -> int:
    cells = [[object()]]
    return _Probe()(*(cell[0] for cell in cells))


BASE_REFCOUNT = _base_refcount()
