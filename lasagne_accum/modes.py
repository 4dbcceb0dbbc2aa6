"""Compilation modes: :func:`mode`, the one opt-in to the library's fast paths.

Importing lasagne_accum changes nothing in PyTensor. The library's graph
rewrites and backend fixes are included by name, in the functions compiled
with the Mode that :func:`mode` returns (as PyMC includes its own rewrites
in the functions it compiles):

* C and Numba: the single-function form's step runs on stepping calls only,
  in place (:class:`~lasagne_accum._pytensor.lazy_step.LazyStep`); a
  window's lazy buffer reset is folded into the in-place ``Gemm``; float32
  constants are written exactly into the generated C code;
* Numba: ``acc + dot(a, b)`` is one in-place BLAS ``gemm``, as in C;
* JAX and PyTorch: fixes to how PyTensor converts some ops (float32 models
  stay float32 under JAX; ``arange`` and ``reshape`` of batch-sized shapes
  work under JAX; ``**``, ``%``, ``==`` and ``argmax`` work under PyTorch);
* JAX: every shared variable a function updates is donated to XLA, so its
  new value can take the old buffer's place and the old buffer is freed at
  once: one copy of the state in device memory, not two;
* PyTorch: state stays on the device (``device=``) between calls, as torch
  tensors updated in place; only the outputs you asked for come back to the
  host;
* every backend reads a shared value that another backend left (a JAX array
  in a C function, a torch tensor in a JAX function...) by converting it.

:func:`lasagne_accum.compile_accumulation`, the examples, the benchmarks and
the parameter server compile with it. Plain ``pytensor.function`` gives the
same numbers on C and Numba, only slower; the backends page of the docs says
what differs on PyTensor's own JAX and PyTorch backends.
"""

from __future__ import annotations

from typing import Any

__all__ = ["mode", "default_modes", "blas_available"]


def mode(base: Any = "CVM", *, device: Any = None, compile: bool | None = None) -> Any:
    """A PyTensor Mode: `base` with lasagne_accum's rewrites and backend fixes.

    Parameters
    ----------
    base : str, pytensor Mode or None
        A predefined mode's name (``"CVM"``, ``"C"``, ``"NUMBA"``, ``"JAX"``,
        ``"PYTORCH"``, ``"FAST_RUN"``, ...; ``"C"`` compiles the whole graph
        into one C module and so refuses a graph with an operation that has no
        C code, such as integer-array indexing, which ``"CVM"`` runs in
        Python), a Mode of your own, whose
        rewrites are kept, or None for PyTensor's default mode
        (``pytensor.config.mode``).
    device : str or torch.device, optional
        PyTorch only: where the state lives and the graph runs (``"cuda"``,
        ``"cuda:1"``, ``"cpu"``...). Default: CUDA when torch sees a GPU,
        else the CPU. JAX places arrays on its own default device
        (``jax.default_device``, ``JAX_PLATFORMS``) and refuses `device`.
    compile : bool, optional
        PyTorch only: run the graph through ``torch.compile`` (fused kernels,
        compiled on the first call and again for new input shapes) or
        eagerly. Default: compiled on an accelerator, eager on the CPU, where
        compiling takes longer than it saves and the C and Numba backends
        are the fast path.

    Returns
    -------
    pytensor.compile.mode.Mode
        For ``pytensor.function(..., mode=...)``. Outside the PyTensor
        releases the library is tested with, PyTensor's own `base` (with one
        warning): the same numbers, without the fast paths; likewise for a
        Mode of another kind (``DebugMode``) or backend.

    Raises
    ------
    TypeError
        If `base` is neither a mode name nor a Mode.
    ValueError
        If `base` names no PyTensor mode; if `device` is not a device of this
        machine; if `device` or `compile` is given for a backend other than
        PyTorch.

    Notes
    -----
    JAX: the buffers of updated shared variables are donated, so a JAX array
    you took with ``get_value(borrow=True)`` could be freed by the next call.
    The function checks first: a value held anywhere else is copied and the
    copy donated, so what you hold stays valid (at the cost of that copy);
    ``get_value()`` (a copy) never shares a buffer. Two shared variables that
    share one value (a ``clone()``) cannot both be updated by one function.

    PyTorch: a state tensor keeps its storage across calls (updated with
    ``copy_``) unless an update changes its shape or is a view of an input.

    Examples
    --------
    >>> import numpy as np, pytensor, pytensor.tensor as pt
    >>> import lasagne_accum as la
    >>> w = pytensor.shared(np.zeros(2), name="w")
    >>> g = pt.vector("g")
    >>> f = pytensor.function([g], [], updates=la.sgd([g], [w], 1.0, average=2),
    ...                       mode=la.mode("CVM"))
    >>> _ = f(np.ones(2)); w.get_value()          # no step on the first call
    array([0., 0.])
    >>> _ = f(np.full(2, 3.0)); w.get_value()     # the mean gradient, 2
    array([-2., -2.])
    >>> la.mode("CVM", device="cpu")
    Traceback (most recent call last):
    ...
    ValueError: mode(): device= applies to the PYTORCH backend only; the C and Numba backends run on the CPU
    """
    from pytensor.compile.mode import get_mode

    from ._pytensor.modes import build

    if base is not None and not isinstance(base, str) and not hasattr(base, "linker"):
        raise TypeError(f"mode(): base must be a mode name, a pytensor Mode or None, "
                        f"got {base!r}")
    if isinstance(base, str):
        try:
            get_mode(base)
        except (KeyError, ValueError):
            raise ValueError(f"mode(): {base!r} is not a PyTensor mode (try 'CVM', 'NUMBA', "
                             "'JAX' or 'PYTORCH')") from None
    return build(base, device=device, compile=compile)


def blas_available() -> bool:
    """True when PyTensor's C backend links to a BLAS library."""
    import pytensor

    return bool(pytensor.config.blas__ldflags)


def float_dtype(variables: Any) -> str | None:
    """``"float64"`` or ``"float32"`` when `variables`' types say so (the wider wins), else
    None (``pytensor.config.floatX``): the dtype :func:`default_modes` measures for."""
    dtypes = {getattr(getattr(v, "type", None), "dtype", None) for v in variables}
    if "float64" in dtypes:
        return "float64"
    return "float32" if "float32" in dtypes else None


def default_modes(dtype: str | None = None) -> tuple[str, str]:
    """The base modes :func:`~lasagne_accum.compile_accumulation` uses when none is given.

    Chosen by measurement on the machine at hand, not by assumption: the C
    backend runs the BLAS PyTensor links (a system OpenBLAS older than the CPU
    runs generic kernels several times slower), Numba runs SciPy's. The first
    call times a small accumulate step (two dense layers' forward and backward
    pass into gradient buffers) and apply step (Adam) under both backends, in
    a child process, and keeps the result beside PyTensor's compile directory;
    later calls, in any process, read it (see
    :func:`lasagne_accum.machine.measured_modes`, and :func:`show_config` for
    the figures).

    Parameters
    ----------
    dtype : {"float32", "float64"}, optional
        The model's float type (default ``pytensor.config.floatX``):
        :func:`~lasagne_accum.compile_accumulation` passes its parameters'.

    Returns
    -------
    (accumulate_mode, apply_mode) : tuple of str
        Each ``"CVM"`` or ``"NUMBA"``, the faster of the two for that step
        (C on a tie); compiled through :func:`mode`.

    Raises
    ------
    ValueError
        If `dtype` is not float32 or float64.

    Notes
    -----
    A measurement is redone when the machine, the PyTensor, Numba, NumPy or
    SciPy release, ``blas__ldflags``, the thread variables
    (``OMP_NUM_THREADS``...) or the library's probe change, and when its file
    cannot be read or holds no valid timings. A mode you pass
    (``mode=``/``apply_mode=``) is always used as given.

    Both backends give the same numbers to float64 rounding; in float32 they
    may differ in the last bits (a BLAS sums a matrix product's terms in an
    order of its own), so a run can differ in float32's last digits between
    two machines whose measurements picked different backends.

    Examples
    --------
    >>> import lasagne_accum as la
    >>> la.default_modes("float32") in [("CVM", "NUMBA"), ("NUMBA", "NUMBA"),
    ...                                 ("CVM", "CVM"), ("NUMBA", "CVM")]
    True
    """
    from .machine import measured_modes

    return measured_modes(dtype).modes
