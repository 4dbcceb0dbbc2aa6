"""Our JAX linker: PyTensor's, with fixes, donating the buffers of updated state.

Fixes to how some ops are converted. Each that works around an upstream bug
names its reproducer on plain PyTensor (written up in the docs' backends
page), a test of ``tests/test_upstream_jax.py``, which says when PyTensor
has fixed the bug upstream:

* A reduction (``CAReduce``: ``Sum``, ``Prod``...) returns its
  *accumulator* dtype, so the bias gradient of a float32 model comes back
  float64 and, through the update, turns float32 shared variables into
  float64 ones; ``Alloc`` of a 0-d constant (which PyTensor hands JAX as a
  Python number) and ``DeepCopyOp`` of one come back float64 too. Fixed by
  casting their result to the output's dtype. On PyTensor 3.3 an ``ifelse``
  becomes a ``LazyIfElse`` whose branches are inner graphs: there each
  branch's results are cast to the output dtypes (``jax.lax.cond`` refuses
  branches whose dtypes differ).
* Shapes are Python integers inside ``jax.jit``, but PyTensor computes
  with them in ``jax.numpy`` (traced values), and ``ARange`` hands its
  constant bounds over as int8 scalars: ``pt.arange(y.shape[0])`` of 128 or
  more and any ``reshape`` to a shape computed from a batch size fail.
  Scalar and short-vector ops whose inputs are known while JAX traces are
  computed with numpy (the op's own ``perform``), so shapes stay concrete;
  assertions on them are checked instead of dropped. PyTensor 3.3 fixed
  the ``ARange`` bounds (``FIXED_UPSTREAM``): there that fix is left out.

Each such node's op is swapped for :class:`~.linkers.Fixed` just before
conversion (see :mod:`.linkers`).

State (the shared variables a function updates): donated to XLA
(:class:`DonatingCall`), so the new value takes the old buffer; PyTensor's
stale compile-time copy of every shared value is dropped
(:func:`_drop_shadowed_globals`), another upstream bug with its reproducer
there.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from pytensor.link.jax.linker import JAXLinker as _PyTensorJAXLinker

from . import fixed_upstream
from .linkers import Fixed, _label, _output_cells, _registered, _swap, _updated_inputs
from .values import BASE_REFCOUNT, refcounts, to_host

__all__ = ["DonatingCall", "JAXLinker"]


# reproducer: test_jax_keeps_a_stale_copy_of_every_shared_value
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


# reproducer: test_jax_returns_float64_for_float32_graphs
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


# reproducer: test_jax_arange_refuses_a_stop_of_128_or_more
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


# reproducer: test_jax_reshape_to_a_shape_computed_from_the_batch_fails
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


# reproducer: test_jax_lazy_ifelse_branches_disagree_in_dtype_on_a_float32_graph
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
