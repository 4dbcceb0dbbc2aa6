"""Our PyTorch linker: PyTensor's, with fixes, keeping state on a device.

Fixes to how some ops are converted. Each that works around an upstream bug
names its reproducer on plain PyTensor (written up in the docs' backends
page), a test of ``tests/test_upstream_pytorch.py``, which says when
PyTensor has fixed the bug upstream:

* The scalar ``Pow`` and ``Mod`` map to ``torch.power`` and
  ``torch.mod``, which do not exist (``torch.pow``, ``torch.remainder``);
  ``EQ`` maps to ``torch.equal``, which compares whole tensors to one Python
  bool (the elementwise function is ``torch.eq``); ``Argmax`` has no
  conversion.
* Shapes are made on the default device (on a GPU, every assertion on a
  shape would wait for the device): made on the CPU here.

Each such node's op is swapped for :class:`~.linkers.Fixed` just before
conversion (see :mod:`.linkers`).

State (the shared variables a function updates): torch tensors on the mode's
device, updated in place (:class:`TorchCall`); PyTensor's own linker moves
all of it to the device and back on each call (a reproducer there too).
"""

from __future__ import annotations

import numpy as np
from pytensor.link.pytorch.linker import PytorchLinker as _PyTensorPytorchLinker

from .linkers import Fixed, _label, _output_cells, _registered, _swap, _updated_inputs
from .values import to_torch

__all__ = ["PytorchLinker", "TorchCall"]


# reproducer: test_pytorch_maps_pow_mod_and_eq_to_the_wrong_torch_functions
def _torch_elementwise(name):
    def fix(op, node=None, **kwargs):
        import torch

        return getattr(torch, name)

    fix.__name__ = f"torch_{name}"
    return fix


_TORCH_SCALAR = {"Pow": _torch_elementwise("pow"), "Mod": _torch_elementwise("remainder"),
                 "EQ": _torch_elementwise("eq")}


# reproducer: test_pytorch_has_no_argmax_and_returns_state_through_the_host
def _torch_argmax(op, node=None, **kwargs):
    """``Argmax`` over the op's axes (PyTensor 3.0.7 has no PyTorch conversion for it)."""
    import torch

    ndim = node.inputs[0].type.ndim
    axes = tuple(range(ndim)) if op.axis is None else tuple(int(a) for a in op.axis)
    kept = [a for a in range(ndim) if a not in axes]

    def argmax(x):
        if len(axes) == 1:
            return torch.argmax(x, dim=axes[0])
        moved = x.permute(*kept, *axes)   # reduced axes last, flattened into one
        flat = moved.reshape(*moved.shape[:len(kept)], -1)
        return torch.argmax(flat, dim=-1)

    return argmax


def _torch_shape(op, node=None, **kwargs):
    """A shape as a CPU tensor, wherever the graph runs.

    PyTensor makes it with ``torch.tensor``, on the default device: on a GPU,
    every assertion and ``arange`` on a shape would wait for the device.
    """
    import torch

    cpu = torch.device("cpu")
    if hasattr(op, "i"):   # Shape_i
        i = op.i

        def shape_i(x):
            return torch.tensor(x.shape[i], device=cpu)

        return shape_i

    def shape(x):
        return torch.tensor(x.shape, device=cpu)

    return shape


def _torch_fix_for(node):
    from pytensor.scalar.basic import EQ, Mod, Pow
    from pytensor.tensor.elemwise import Elemwise
    from pytensor.tensor.math import Argmax
    from pytensor.tensor.shape import Shape, Shape_i

    op = node.op
    if isinstance(op, Elemwise) and type(op.scalar_op) in (Pow, Mod, EQ):
        return _TORCH_SCALAR[type(op.scalar_op).__name__]
    if isinstance(op, Argmax):
        return _torch_argmax
    if isinstance(op, (Shape, Shape_i)):
        return _torch_shape
    return None


def _register_pytorch():
    if "pytorch" in _registered:
        return
    from pytensor.link.pytorch.dispatch import pytorch_funcify

    @pytorch_funcify.register(Fixed)
    def pytorch_funcify_Fixed(op, node=None, **kwargs):
        return op.fix(op.op, node=node, **kwargs)

    _registered.add("pytorch")


def _views_of_inputs(fgraph) -> set[int]:
    """Output positions whose value is an input or a view of one (by the ops' view maps)."""
    from pytensor.compile.aliasing import alias_root

    inputs = set(fgraph.inputs)
    out = set()
    for k, var in enumerate(fgraph.outputs):
        try:
            root = alias_root(var)
        except NotImplementedError:   # a view of several inputs
            out.add(k)
            continue
        if root in inputs:
            out.add(k)
    return out


# reproducers: test_pytorch_has_no_argmax_and_returns_state_through_the_host (state
# through the host), test_a_jax_value_cannot_be_read_by_pytorch (a JAX array as input)
class TorchCall:
    """A PyTorch-mode function: state on `device`, updated in place.

    Called as PyTensor's thunk calls it. Inputs are put on the device (a value
    there already is used as it is: no copy per call); each updated state
    tensor receives its new value with ``copy_`` (its storage, and
    ``data_ptr()``, stay the same) where the new value has its shape and is
    not itself a view of an input. Updated state is returned as device
    tensors, which PyTensor stores in the shared variables; the function's
    other outputs are returned as numpy arrays, as PyTensor's PyTorch backend
    returns them.

    Attributes
    ----------
    device : torch.device
    compiled : bool, whether the graph runs through ``torch.compile``.
    """

    def __init__(self, fn, functors, device, pairs, updates, protect, views, names,
                 tensors, out_cells, compiled):
        import torch

        self.device = device
        self.compiled = compiled
        self._fn = fn
        self._functors = functors
        self._pairs = tuple(pairs)          # (output position, input position), in place
        self._updates = frozenset(updates)  # output positions that are new state values
        self._protect = tuple(protect)      # returned outputs: copied if they alias state
        self._views = frozenset(views)      # outputs that are inputs or views of inputs
        self._names = names
        self._tensors = frozenset(tensors)  # input positions of tensor type
        self._out_cells = out_cells
        self._run = torch.compile(self._step) if compiled else self._step

    def _step(self, *args):
        import torch

        outs = list(self._fn(*args))
        targets = [args[i] for _, i in self._pairs]
        for k in self._protect:   # an input's old value, about to be overwritten
            if any(outs[k] is t for t in targets) or k in self._views:
                outs[k] = outs[k].clone()
        for o, i in self._pairs:
            target, value = args[i], outs[o]
            if (value is target or not isinstance(value, torch.Tensor)
                    or target.shape != value.shape):
                continue
            target.copy_(value)
            outs[o] = target
        return outs

    def __call__(self, *inputs):
        import torch

        for cell in self._out_cells:
            cell[0] = None
        device = self.device
        args = []
        for i, value in enumerate(inputs):
            if isinstance(value, torch.Tensor) and value.device == device:
                args.append(value)
            elif i in self._tensors:
                args.append(to_torch(value, device, self._names[i]))
            else:   # not a tensor input (a random generator...): PyTensor's conversion
                from pytensor.link.pytorch.dispatch import pytorch_typify

                args.append(pytorch_typify(value))
        self._separate(args)
        if self.compiled:
            import pytensor.link.utils as where

            for name, functor in self._functors:
                setattr(where, name, functor)
        try:
            with torch.no_grad(), torch.device(device):
                outs = self._run(*args)
        finally:
            if self.compiled:
                for name, _ in self._functors:
                    if hasattr(where, name):
                        delattr(where, name)
        return [outs[k] if k in self._updates else _host(outs[k]) for k in range(len(outs))]

    def _separate(self, args):
        """Give an updated tensor that shares memory with another input a copy of its own."""
        seen: dict[int, int] = {}
        for _, i in self._pairs:
            pointer = _storage(args[i])
            if pointer:
                seen.setdefault(pointer, i)
        for j, value in enumerate(args):
            owner = seen.get(_storage(value))
            if owner is not None and owner != j:
                args[owner] = args[owner].clone()
                seen[_storage(args[owner])] = owner


def _storage(value) -> int:
    """The address of a tensor's storage (0: none, as on the ``meta`` device, or not a tensor)."""
    storage = getattr(value, "untyped_storage", None)
    return storage().data_ptr() if storage is not None else 0


def _host(value):
    """An output the function returns, as a numpy array."""
    if hasattr(value, "detach"):
        return value.detach().cpu().numpy()
    return np.asarray(value)


class PytorchLinker(_PyTensorPytorchLinker):
    """PyTensor's PyTorch linker with our fixes, keeping state on a device (:class:`TorchCall`).

    Parameters
    ----------
    device : torch.device
        Where state lives and the graph runs.
    compile : bool
        Run the graph through ``torch.compile`` (PyTensor's choice); False
        runs it eagerly (no compile time).
    """

    def __init__(self, *args, device=None, compile=True, **kwargs):
        super().__init__(*args, **kwargs)
        self.device = device
        self.compile = compile

    def accept(self, fgraph, no_recycling=None, profile=None):
        if self.fgraph is not None and self.fgraph is not fgraph:
            return type(self)(allow_gc=self.allow_gc, device=self.device,
                              compile=self.compile).accept(fgraph, no_recycling, profile)
        return super().accept(fgraph, no_recycling, profile)

    def fgraph_convert(self, fgraph, input_storage, storage_map, **kwargs):
        import warnings

        import torch
        from pytensor.tensor.type import TensorType

        _register_pytorch()
        _swap(fgraph, _torch_fix_for)
        updated = _updated_inputs(fgraph, storage_map)
        mapping = getattr(fgraph, "update_mapping", None) or {}
        views = self._views = _views_of_inputs(fgraph)
        self._pairs = [(o, i) for o, i in sorted(mapping.items())
                       if i in updated and o not in views]
        self._update_outputs = set(mapping)
        self._names = [_label(v) for v in fgraph.inputs]
        self._tensors = [i for i, v in enumerate(fgraph.inputs)
                         if isinstance(v.type, TensorType)]
        self._out_cells = _output_cells(fgraph, storage_map)
        # the inputs' current values are not converted now (PyTensor would keep a stale
        # copy of each, and cannot convert a JAX array): the function gets them per call
        converting = dict(storage_map)
        for var in fgraph.inputs:
            converting[var] = [None]
        with torch.device(self.device), warnings.catch_warnings():
            # constants are made on the device; on the CPU, torch shares the memory of
            # PyTensor's (read-only) constants and warns that they are read-only
            warnings.filterwarnings("ignore", "The given NumPy array is not writable")
            return super().fgraph_convert(fgraph, input_storage=input_storage,
                                          storage_map=converting, **kwargs)

    def jit_compile(self, fn):
        n_out = len(self.fgraph.outputs)
        returned = [k for k in range(n_out) if k not in self._update_outputs]
        call = TorchCall(fn, list(self.gen_functors), self.device, self._pairs,
                         self._update_outputs, returned, self._views, self._names,
                         self._tensors, self._out_cells, self.compile)
        self.gen_functors = []
        return call
