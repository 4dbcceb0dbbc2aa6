"""Our JAX, PyTorch, C and Numba linkers: PyTensor's, with fixes and state handling.

Fixes to how some ops are converted, each written up with a reproducer on
plain PyTensor in the docs' backends page (and checked by
``tests/test_upstream.py``, which says when PyTensor has fixed it upstream):

* JAX: a reduction (``CAReduce``: ``Sum``, ``Prod``...) returns its
  *accumulator* dtype, so the bias gradient of a float32 model comes back
  float64 and, through the update, turns float32 shared variables into
  float64 ones; ``Alloc`` of a 0-d constant (which PyTensor hands JAX as a
  Python number) and ``DeepCopyOp`` of one come back float64 too. Fixed by
  casting their result to the output's dtype. On PyTensor 3.3 an ``ifelse``
  becomes a ``LazyIfElse`` whose branches are inner graphs: there each
  branch's results are cast to the output dtypes (``jax.lax.cond`` refuses
  branches whose dtypes differ).
* JAX: shapes are Python integers inside ``jax.jit``, but PyTensor computes
  with them in ``jax.numpy`` (traced values), and ``ARange`` hands its
  constant bounds over as int8 scalars: ``pt.arange(y.shape[0])`` of 128 or
  more and any ``reshape`` to a shape computed from a batch size fail.
  Scalar and short-vector ops whose inputs are known while JAX traces are
  computed with numpy (the op's own ``perform``), so shapes stay concrete;
  assertions on them are checked instead of dropped. PyTensor 3.3 fixed
  the ``ARange`` bounds (``FIXED_UPSTREAM``): there that fix is left out.
* PyTorch: the scalar ``Pow`` and ``Mod`` map to ``torch.power`` and
  ``torch.mod``, which do not exist (``torch.pow``, ``torch.remainder``);
  ``EQ`` maps to ``torch.equal``, which compares whole tensors to one Python
  bool (the elementwise function is ``torch.eq``); ``Argmax`` has no
  conversion; shapes are made on the default device (on a GPU, every
  assertion on a shape would wait for the device): made on the CPU here.

The linkers swap the op of each such node, in the function's own graph just
before conversion, for :class:`Fixed`, whose conversion (registered for
that class alone) calls PyTensor's own and applies the fix. Ops inside inner
graphs (``Scan``, ``OpFromGraph``) are converted by PyTensor alone.

State (the shared variables a function updates):

* JAX: donated to XLA (:class:`DonatingCall`), so the new value takes the
  old buffer; PyTensor's stale compile-time copy of every shared value is
  dropped (:func:`_drop_shadowed_globals`).
* PyTorch: torch tensors on the mode's device, updated in place
  (:class:`TorchCall`).
* C and Numba: a JAX array or torch tensor left by another mode's function
  is copied to the host first (:class:`HostCall`).
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
from pytensor.graph.basic import Apply
from pytensor.graph.op import Op
from pytensor.link.jax.linker import JAXLinker as _PyTensorJAXLinker
from pytensor.link.pytorch.linker import PytorchLinker as _PyTensorPytorchLinker

from . import fixed_upstream
from .values import BASE_REFCOUNT, refcounts, to_host, to_torch

__all__ = ["Fixed", "JAXLinker", "PytorchLinker"]

_registered: set[str] = set()


class Fixed(Op):
    """An op that our linker converts with a fix (see the module notes).

    Parameters
    ----------
    op : Op
        The op of the node.
    fix : callable
        ``fix(op, node, **kwargs)``: the backend function for the node.
    """

    __props__ = ("op", "fix")

    def __init__(self, op: Op, fix: Callable[..., Any]):
        self.op, self.fix = op, fix
        self.view_map = dict(getattr(op, "view_map", {}))
        self.destroy_map = dict(getattr(op, "destroy_map", {}))

    def __str__(self):
        return str(self.op)

    def make_node(self, *inputs):
        node = self.op.make_node(*inputs)
        return Apply(self, node.inputs, node.outputs)

    def perform(self, node, inputs, output_storage):
        self.op.perform(node, inputs, output_storage)


def _swap(fgraph, fix_for: Callable[[Apply], Any]) -> None:
    for node in fgraph.apply_nodes:
        if isinstance(node.op, Fixed):
            continue
        fix = fix_for(node)
        if fix is not None:
            node.op = Fixed(node.op, fix)


def _updated_inputs(fgraph, storage_map) -> list[int]:
    """Indices of the fgraph inputs that the function updates (shared variables).

    Raises
    ------
    ValueError
        If two updated inputs share one value (a shared variable and its
        ``clone()``): two outputs would be written to one buffer, and donating
        it twice is an error in JAX and writing it twice a silent race in place.
    """
    from pytensor.tensor.type import TensorType

    mapping = getattr(fgraph, "update_mapping", None) or {}
    updated = sorted({i for i in mapping.values()
                      if isinstance(fgraph.inputs[i].type, TensorType)})
    cells: dict[int, int] = {}
    for i in updated:
        cell = storage_map.get(fgraph.inputs[i]) if storage_map is not None else None
        if cell is None:
            continue
        if id(cell) in cells:
            name, other = _label(fgraph.inputs[i]), _label(fgraph.inputs[cells[id(cell)]])
            pair = (f"{name} and a clone() of it share one value" if name == other else
                    f"{other} and {name} share one value (one is a clone() of the other)")
            raise ValueError(
                f"{name} is updated twice in one function: {pair}, so two updated outputs "
                "would alias one buffer; update only one of them")
        cells[id(cell)] = i
    return updated


def _label(variable) -> str:
    return variable.name or str(variable)


def _drop_shadowed_globals(fn) -> None:
    """Forget the converted values of `fn`'s inputs that PyTensor keeps in its globals.

    PyTensor's code generator converts every input that has a value when the
    function is built (the shared variables) and keeps the result in the
    generated function's globals under the input's own name, where the
    argument of that name shadows it: a stale second copy of every shared
    value, on the device, for the life of the function.
    """
    code = getattr(fn, "__code__", None)
    namespace = getattr(fn, "__globals__", None)
    if code is None or namespace is None:
        return
    for name in code.co_varnames[:code.co_argcount]:
        namespace.pop(name, None)


def _output_cells(fgraph, storage_map) -> list[list]:
    """The storage cells of computed outputs (not the cells of inputs passed through)."""
    if storage_map is None:
        return []
    inputs = {id(storage_map.get(i)) for i in fgraph.inputs}
    cells = []
    for out in fgraph.outputs:
        cell = storage_map.get(out)
        if out.owner is not None and cell is not None and id(cell) not in inputs:
            cells.append(cell)
    return cells


# ------------------------------------------------------------------------------- JAX
def _jax_in_output_dtype(op, node=None, **kwargs):
    """PyTensor's JAX function for `op`, its result cast to the output's dtype."""
    from pytensor.link.jax.dispatch import jax_funcify

    inner = jax_funcify(op, node=node, **kwargs)
    dtype = node.outputs[0].type.dtype

    def in_output_dtype(*inputs):
        return inner(*inputs).astype(dtype)

    return in_output_dtype


def _concrete(values) -> bool:
    """True when no value is a JAX tracer (all are known while JAX traces)."""
    from jax.core import Tracer

    return not any(isinstance(v, Tracer) for v in values)


def _jax_arange(op, node=None, **kwargs):
    """``jax.numpy.arange`` of bounds known while tracing (constants, shapes, sums of them)."""
    import jax.numpy as jnp
    from pytensor.link.jax.dispatch import jax_funcify

    dtype = op.dtype
    traced = None

    def arange(start, stop, step):
        nonlocal traced
        if _concrete((start, stop, step)):
            return jnp.arange(int(start), int(stop), int(step), dtype=dtype)
        if traced is None:   # PyTensor's, with its error for bounds known only at run time
            traced = jax_funcify(op, node=node, **kwargs)
        return traced(start, stop, step)

    return arange


def _output_inputs(op, node) -> list[frozenset[int]]:
    """For each output of `node`, the positions of the inputs it depends on.

    All of them, except for an ``Elemwise`` of a ``Composite`` (what fusion
    makes), where its inner scalar graph says: fusion can put a shape's
    arithmetic and a traced value's into one node.
    """
    from pytensor.graph.traversal import ancestors
    from pytensor.scalar.basic import Composite
    from pytensor.tensor.elemwise import Elemwise

    every = frozenset(range(len(node.inputs)))
    if not (isinstance(op, Elemwise) and isinstance(op.scalar_op, Composite)):
        return [every] * len(node.outputs)
    inner = op.scalar_op.fgraph
    deps = []
    for out in inner.outputs:
        above = set(ancestors([out]))
        deps.append(frozenset(k for k, i in enumerate(inner.inputs) if i in above))
    return deps


def _static(fallback):
    """A fix that computes the node with numpy when its inputs are known while tracing.

    Shapes are Python integers inside ``jax.jit``; arithmetic on them in
    ``jax.numpy`` makes traced values, which ``reshape`` and ``arange`` refuse.
    Computed by the op's own ``perform``, the results stay concrete. In a
    fused node, the outputs that depend on known inputs only are computed so
    (the traced inputs replaced by ones), the others by JAX.
    """

    def fix(op, node=None, **kwargs):
        if fallback is None:
            from pytensor.link.jax.dispatch import jax_funcify

            inner = jax_funcify(op, node=node, **kwargs)
        else:
            inner = fallback(op, node=node, **kwargs)
        dtypes = [i.type.dtype for i in node.inputs]
        shapes = [i.type.shape for i in node.inputs]
        deps = _output_inputs(op, node)
        scalars = all(o.type.ndim == 0 for o in node.outputs)   # no shape from a dummy

        def numpy_values(inputs, known):
            values = [np.asarray(v, dtype=d) if k in known else
                      np.ones([1 if n is None else n for n in shape], dtype=d)
                      for k, (v, d, shape) in enumerate(zip(inputs, dtypes, shapes))]
            storage: list[list[Any]] = [[None] for _ in node.outputs]
            with np.errstate(all="ignore"):
                op.perform(node, values, storage)
            return [cell[0] for cell in storage]

        def static_or_traced(*inputs):
            known = {k for k, v in enumerate(inputs) if _concrete((v,))}
            if len(known) == len(inputs):
                results = numpy_values(inputs, known)
            else:
                static = [scalars and d <= known for d in deps]
                if not any(static):
                    return inner(*inputs)
                traced = inner(*inputs)
                traced = list(traced) if isinstance(traced, (list, tuple)) else [traced]
                values = numpy_values(inputs, known)
                results = [v if s else t for v, s, t in zip(values, static, traced)]
            return results[0] if len(results) == 1 else tuple(results)

        return static_or_traced

    fix.__name__ = f"static_{getattr(fallback, '__name__', 'pytensor')}"
    return fix


_STATIC_CACHE: dict[Any, Any] = {}


def _maybe_static(node) -> bool:
    """Ops on scalars and short vectors that may compute shapes (checked again while tracing)."""
    from pytensor.scalar.basic import ScalarType
    from pytensor.tensor.basic import MakeVector, ScalarFromTensor, TensorFromScalar
    from pytensor.tensor.elemwise import DimShuffle, Elemwise
    from pytensor.tensor.type import TensorType

    if not isinstance(node.op, (Elemwise, ScalarFromTensor, TensorFromScalar, MakeVector,
                                DimShuffle)):
        return False
    for var in (*node.inputs, *node.outputs):
        if isinstance(var.type, TensorType):
            if var.type.ndim > 1:
                return False
        elif not isinstance(var.type, ScalarType):
            return False
    return True


def _jax_check(op, node=None, **kwargs):
    """An assertion checked while JAX traces when its conditions are known then (shapes).

    PyTensor's JAX backend drops every assertion, with a warning; most check
    shapes, which are known inside ``jax.jit``: those raise as they do in the
    other backends, and the warning is left for the rest.
    """
    import warnings

    def check(x, *conditions):
        if _concrete(conditions):
            for condition in conditions:
                if not bool(np.all(np.asarray(condition))):
                    raise op.exc_type(op.msg)
        else:
            warnings.warn(f"Skipping {op} Op (assertion: {op.msg}) as JAX tracing would "
                          "remove it.", stacklevel=2)
        return x

    return check


def _jax_lazy_ifelse(op, node=None, **kwargs):
    """PyTensor's ``LazyIfElse`` (3.3+) with each branch's results cast to the output dtypes.

    The branches are inner graphs, which PyTensor converts alone (without the
    fixes above): an ``Alloc`` of a float32 constant there comes back float64,
    and ``jax.lax.cond`` refuses branches whose dtypes differ.
    """
    import jax
    import jax.numpy as jnp
    from pytensor.link.jax.dispatch import jax_funcify

    dtypes = [t.dtype for t in op.output_types]

    def in_output_dtypes(fn):
        def branch(*args):
            outs = fn(*args)
            if len(dtypes) == 1:
                return jnp.asarray(outs, dtype=dtypes[0])
            return tuple(jnp.asarray(o, dtype=d) for o, d in zip(outs, dtypes))

        return branch

    true_fn = in_output_dtypes(jax_funcify(op.true_branch, **kwargs))
    false_fn = in_output_dtypes(jax_funcify(op.false_branch, **kwargs))

    def lazy_ifelse(cond, *args):
        return jax.lax.cond(cond, true_fn, false_fn, *args)

    return lazy_ifelse


def _jax_fix_for(node):
    from pytensor.compile.ops import DeepCopyOp
    from pytensor.raise_op import CheckAndRaise
    from pytensor.tensor.basic import Alloc, ARange
    from pytensor.tensor.elemwise import CAReduce

    from .compat import LazyIfElse

    if LazyIfElse is not None and isinstance(node.op, LazyIfElse):
        return _jax_lazy_ifelse
    if isinstance(node.op, ARange) and not fixed_upstream("jax_arange"):
        return _jax_arange
    if isinstance(node.op, CheckAndRaise):
        return _jax_check
    dtype_fix = None
    if isinstance(node.op, (CAReduce, Alloc, DeepCopyOp)) and getattr(
            node.outputs[0].type, "dtype", None) is not None:   # not a generator
        dtype_fix = _jax_in_output_dtype
    if _maybe_static(node):
        if dtype_fix not in _STATIC_CACHE:
            _STATIC_CACHE[dtype_fix] = _static(dtype_fix)
        return _STATIC_CACHE[dtype_fix]
    return dtype_fix


def _register_jax():
    if "jax" in _registered:
        return
    from pytensor.link.jax.dispatch import jax_funcify

    @jax_funcify.register(Fixed)
    def jax_funcify_Fixed(op, node=None, **kwargs):
        return op.fix(op.op, node=node, **kwargs)

    _registered.add("jax")


class DonatingCall:
    """The jitted function of a JAX-mode function, donating the buffers of its state.

    Called as PyTensor's thunk calls it, with every input's current value.
    Before JAX runs, each updated input (donated: JAX frees its buffer and may
    write the new value there) is checked:

    * a value of another backend (a torch tensor) is converted (through the
      host);
    * a deleted JAX array raises :class:`RuntimeError` naming the variable;
    * a JAX array that something else holds too (``get_value(borrow=True)``,
      another shared variable) is copied first and the copy donated, so what
      a user holds stays valid.

    Attributes
    ----------
    jitted : the ``jax.jit`` function (``jitted.lower(...)`` for the memory plan).
    donated : tuple of int, the donated argument positions.
    """

    def __init__(self, jitted, donated, names, out_cells, static_args, convert):
        self.jitted = jitted
        self.donated = tuple(donated)
        self._names = names
        self._out_cells = out_cells
        self._static_args = tuple(static_args)
        self._convert = tuple(convert)

    def __call__(self, *args):
        for cell in self._out_cells:   # last call's outputs: the state's current values
            cell[0] = None
        counts = refcounts(args, self.donated)
        fixed = None
        for i, count in zip(self.donated, counts):
            value = args[i]
            if type(value).__module__.startswith("jaxlib"):
                if value.is_deleted():
                    raise RuntimeError(
                        f"{self._names[i]}: its value is a JAX array that has been deleted "
                        "(its buffer was donated to another JAX function, or deleted by "
                        f"hand); give it a new value with {self._names[i]}.set_value(...)")
                if count > BASE_REFCOUNT:   # held elsewhere too: donate a copy
                    fixed = fixed or list(args)
                    fixed[i] = value.copy()
        for i in self._convert:
            value = (fixed or args)[i]
            if type(value).__module__.startswith("torch"):
                fixed = fixed or list(args)
                fixed[i] = to_host(value, self._names[i], "jax")
        if self._static_args:
            fixed = fixed or list(args)
            for i in self._static_args:
                fixed[i] = int(fixed[i])
        return self.jitted(*(fixed or args))


class JAXLinker(_PyTensorJAXLinker):
    """PyTensor's JAX linker with our fixes, donating the buffers of updated state.

    See the module notes for the fixes. Donation: every shared variable the
    function updates is passed to ``jax.jit`` through ``donate_argnums``, so
    XLA can write its new value into the old buffer and the old one is freed
    at once (:class:`DonatingCall`). PyTensor's converter also keeps a copy of
    every shared value from the time the function was built; dropped here.
    """

    def fgraph_convert(self, fgraph, input_storage, storage_map, **kwargs):
        _register_jax()
        _swap(fgraph, _jax_fix_for)
        self._donated = _updated_inputs(fgraph, storage_map)
        self._names = [_label(v) for v in fgraph.inputs]
        self._out_cells = _output_cells(fgraph, storage_map)
        from pytensor.compile.sharedvalue import SharedVariable

        self._shared = [i for i, v in enumerate(fgraph.inputs) if isinstance(v, SharedVariable)]
        fn = super().fgraph_convert(fgraph, input_storage=input_storage,
                                    storage_map=storage_map, **kwargs)
        _drop_shadowed_globals(fn)
        return fn

    def jit_compile(self, fn):
        import jax

        static = tuple(self.scalar_shape_inputs)
        donated = tuple(i for i in getattr(self, "_donated", ()) if i not in static)
        jitted = jax.jit(fn, static_argnums=static, donate_argnums=donated)
        return DonatingCall(jitted, donated, getattr(self, "_names", []),
                            getattr(self, "_out_cells", []), static,
                            getattr(self, "_shared", ()))


# --------------------------------------------------------------------------- PyTorch
def _torch_elementwise(name):
    def fix(op, node=None, **kwargs):
        import torch

        return getattr(torch, name)

    fix.__name__ = f"torch_{name}"
    return fix


_TORCH_SCALAR = {"Pow": _torch_elementwise("pow"), "Mod": _torch_elementwise("remainder"),
                 "EQ": _torch_elementwise("eq")}


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


# ------------------------------------------------------------------ C, Numba, Python
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
