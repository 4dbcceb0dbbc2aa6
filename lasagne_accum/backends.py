"""Small fixes to PyTensor's PyTorch backend, applied when that backend loads.

PyTensor 3.0's PyTorch dispatch maps the scalar ``Pow`` op to ``torch.power``,
which does not exist (the function is ``torch.pow``), and its
``ScalarFromTensor`` indexes its input with ``x[()]``, which fails when
TorchDynamo hands it a Python scalar. Either breaks every update rule with a
bias correction (``beta ** t``) or a data-dependent shape. The fixes are
registered on PyTensor's own dispatcher, and only once PyTensor imports its
PyTorch dispatch module (so importing this library never imports torch).
"""

import importlib.abc
import importlib.util
import sys

__all__ = ["register_pytorch_fixes"]

_DISPATCH_MODULE = "pytensor.link.pytorch.dispatch"
_registered = False


def register_pytorch_fixes():
    """Register the fixes on ``pytorch_funcify`` (idempotent; imports torch)."""
    global _registered
    if _registered:
        return
    import torch
    from pytensor.link.pytorch.dispatch.basic import pytorch_funcify
    from pytensor.scalar.basic import Pow
    from pytensor.tensor.basic import ScalarFromTensor

    @pytorch_funcify.register(Pow)
    def _pytorch_funcify_pow(op, node, **kwargs):
        return torch.pow

    @pytorch_funcify.register(ScalarFromTensor)
    def _pytorch_funcify_scalar_from_tensor(op, node, **kwargs):
        def scalar_from_tensor(x):
            return x[()] if isinstance(x, torch.Tensor) else torch.as_tensor(x)

        return scalar_from_tensor

    _registered = True


class _Hook(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Run :func:`register_pytorch_fixes` right after PyTensor's dispatch loads."""

    def find_spec(self, fullname, path, target=None):
        if fullname != _DISPATCH_MODULE:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None:
            return None
        self._loader = spec.loader
        spec.loader = self
        return spec

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        register_pytorch_fixes()


def install():
    """Apply the fixes now if PyTensor's PyTorch dispatch is loaded, else on its import."""
    if _DISPATCH_MODULE in sys.modules:
        register_pytorch_fixes()
    elif not any(isinstance(f, _Hook) for f in sys.meta_path):
        sys.meta_path.insert(0, _Hook())
