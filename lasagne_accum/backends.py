"""Small fixes to PyTensor's C, JAX and PyTorch backends.

* C: a float32 constant is written into the generated C code as
  ``str(numpy.float32(0.999))``, i.e. ``0.999``, a *double* literal that is not
  the float32 value 0.99900001... The C code then computes ``1 - beta2`` and
  friends with a slightly different number than Numba, JAX, PyTorch and numpy
  do (5e-6 relative after three Adam steps in float32). The fix writes the
  exact value of the float32 constant (``0.9990000128746033``).

* JAX: PyTensor 3.0's reductions (``CAReduce``: ``Sum``, ``Prod``...) return
  their *accumulator* dtype. A float32 sum accumulates in float64, so the bias
  gradient of a float32 model comes back float64 and, through the update,
  silently turns the float32 shared variables into float64 ones. The fix
  casts each reduction's result to the dtype of its output variable.
  Likewise PyTensor hands JAX a 0-d constant as a Python number, which JAX
  takes as float64: ``Alloc`` (``pt.zeros(shape, dtype="float32")``) then
  broadcast float64 zeros, so the single-function form's ``ifelse`` got a
  float64 branch beside the float32 buffers and JAX refused to trace it; and
  a 0-d constant output (the two-function reset of a float32 scalar, such as
  the weight total) came back float64 through ``DeepCopyOp``. The fix casts
  their result to the output's dtype too.
* PyTorch: the scalar ``Pow`` and ``Mod`` ops are mapped to ``torch.power``
  and ``torch.mod``, which do not exist (``torch.pow``, ``torch.remainder``);
  ``EQ`` is mapped to ``torch.equal``, which compares whole tensors and returns
  one Python bool (the elementwise function is ``torch.eq``); and
  ``ScalarFromTensor`` indexes its input with ``x[()]``, which fails when
  TorchDynamo hands it a Python scalar. Each breaks some rule: bias
  corrections (``beta ** t``), step counters and window conditions, shapes.

* Numba and C fast paths (:mod:`lasagne_accum.fast_ops`): ``acc + dot(a, b)``
  as an in-place BLAS gemm in the Numba backend, and the single-function
  form's step as an op that runs the rule in place only on stepping calls.

The fixes are registered on PyTensor's own dispatchers, and only once PyTensor
imports the backend's dispatch module: importing this library never imports
jax or torch.
"""

import importlib.abc
import importlib.util
import sys

__all__ = ["register_c_fixes", "register_jax_fixes", "register_pytorch_fixes",
           "register_numba_fixes"]

_registered: set[str] = set()


def register_c_fixes():
    """Write float32/float16 constants into C code with their exact value (idempotent)."""
    if "c" in _registered:
        return
    import numpy as np
    from pytensor.scalar.basic import ScalarType

    original = ScalarType.c_literal

    def c_literal(self, data):
        if self.dtype in ("float16", "float32") and np.isfinite(data):
            return repr(float(data))  # the float's exact value, as a double literal
        return original(self, data)

    c_literal.__doc__ = original.__doc__
    ScalarType.c_literal = c_literal
    # Compiled C modules are cached under a key built from, among others, the
    # types' cache versions, not from the code's text: mark the new literals in
    # the version so that no module compiled with the old ones is reused.
    original_version = ScalarType.c_code_cache_version

    def c_code_cache_version(self):
        version = original_version(self)
        return (*version, "exact-float-literals", 1) if version else version

    ScalarType.c_code_cache_version = c_code_cache_version
    _registered.add("c")


def register_jax_fixes():
    """Keep reductions, ``Alloc`` and ``DeepCopyOp`` in their output dtype (idempotent).

    Imports jax.
    """
    if "jax" in _registered:
        return
    from pytensor.compile.ops import DeepCopyOp
    from pytensor.link.jax.dispatch.basic import jax_funcify, jax_funcify_DeepCopyOp
    from pytensor.link.jax.dispatch.elemwise import jax_funcify_CAReduce
    from pytensor.link.jax.dispatch.tensor_basic import jax_funcify_Alloc
    from pytensor.tensor.basic import Alloc
    from pytensor.tensor.elemwise import CAReduce

    def in_output_dtype(original):
        """PyTensor's implementation (with its checks), its result cast to the output's dtype."""

        def funcify(op, node=None, **kwargs):
            inner = original(op, node=node, **kwargs)
            dtype = getattr(node.outputs[0].type, "dtype", None) if node is not None else None
            if dtype is None:  # no node to read it from, or not a tensor (a random generator)
                return inner

            def cast(*inputs):
                return inner(*inputs).astype(dtype)

            return cast

        return funcify

    for op_class, original in ((CAReduce, jax_funcify_CAReduce), (Alloc, jax_funcify_Alloc),
                               (DeepCopyOp, jax_funcify_DeepCopyOp)):
        jax_funcify.register(op_class)(in_output_dtype(original))
    _registered.add("jax")


def register_pytorch_fixes():
    """Register the fixes on ``pytorch_funcify`` (idempotent; imports torch)."""
    if "pytorch" in _registered:
        return
    import torch
    from pytensor.link.pytorch.dispatch.basic import pytorch_funcify
    from pytensor.scalar.basic import EQ, Mod, Pow
    from pytensor.tensor.basic import ScalarFromTensor

    @pytorch_funcify.register(Pow)
    def _pytorch_funcify_pow(op, node, **kwargs):
        return torch.pow

    @pytorch_funcify.register(EQ)
    def _pytorch_funcify_eq(op, node, **kwargs):
        return torch.eq  # elementwise; torch.equal compares whole tensors to one bool

    @pytorch_funcify.register(Mod)
    def _pytorch_funcify_mod(op, node, **kwargs):
        return torch.remainder  # numpy.mod's sign convention; there is no torch.mod

    @pytorch_funcify.register(ScalarFromTensor)
    def _pytorch_funcify_scalar_from_tensor(op, node, **kwargs):
        def scalar_from_tensor(x):
            return x[()] if isinstance(x, torch.Tensor) else torch.as_tensor(x)

        return scalar_from_tensor

    _registered.add("pytorch")


def register_numba_fixes():
    """Register the Numba fast paths of :mod:`lasagne_accum.fast_ops` (idempotent; imports numba)."""
    from .fast_ops import register_numba_gemm, register_numba_lazy_step

    register_numba_gemm()
    register_numba_lazy_step()


_FIXES = {
    "pytensor.link.numba.dispatch": register_numba_fixes,
    "pytensor.link.jax.dispatch": register_jax_fixes,
    "pytensor.link.pytorch.dispatch": register_pytorch_fixes,
}


class _Hook(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Run a backend's fixes right after PyTensor's dispatch module for it loads."""

    def find_spec(self, fullname, path, target=None):
        if fullname not in _FIXES:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None:
            return None
        spec.loader = _FixingLoader(spec.loader, _FIXES[fullname])
        return spec


class _FixingLoader(importlib.abc.Loader):
    def __init__(self, loader, fix):
        self._loader, self._fix = loader, fix

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        self._fix()


def install():
    """Apply each backend's fixes now if its dispatch is loaded, else when it loads."""
    from .fast_ops import (
        register_gemm_reset_rewrite,
        register_lazy_step_rewrite,
        register_numba_gemm_rewrite,
    )

    register_c_fixes()
    register_numba_gemm_rewrite()
    register_gemm_reset_rewrite()
    register_lazy_step_rewrite()
    pending = False
    for module, fix in _FIXES.items():
        if module in sys.modules:
            fix()
        else:
            pending = True
    if pending and not any(isinstance(f, _Hook) for f in sys.meta_path):
        sys.meta_path.insert(0, _Hook())


# ------------------------------------------------ the per-function mode choice
# (moved here from training.py; ``lasagne_accum.training`` re-exports both)


def blas_available():
    """True when PyTensor's C backend links to a BLAS library."""
    import pytensor

    return bool(pytensor.config.blas__ldflags)


def default_modes():
    """The compilation modes the helpers use when none is given.

    Returns
    -------
    (accumulate_mode, apply_mode) : tuple of str
        ``("CVM", "NUMBA")`` when PyTensor's C backend links to a BLAS
        library, else ``("NUMBA", "NUMBA")``.

    Notes
    -----
    Measured in ``benchmarks/backends.py`` on a 784-512-10 MLP: the C backend
    with BLAS fuses the accumulation ``accu + grad`` into the gradient's
    matrix product (``Gemm`` in place), making the accumulate step cheaper
    than PyTensor 3's default Numba backend; Numba's elementwise code makes
    the rule's apply step several times faster than C's. Each function gets
    the backend that is fastest for it.
    """
    return ("CVM" if blas_available() else "NUMBA"), "NUMBA"
