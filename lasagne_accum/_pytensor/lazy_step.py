"""The single-function form's step: a rule that runs on stepping calls only, in place.

The single-function form (``average=N``) selects, on every call, between the
values everything keeps (no step) and the rule's new values plus zeros for
the gradient buffers (a step). :func:`window_step` builds that selection as
one node, :class:`WindowStep`: an ``OpFromGraph`` whose inner graph is
``ifelse(keep, states, stepped)``, marked for inlining. Compiled with a
plain PyTensor mode it is inlined, and PyTensor's lazy ``IfElse`` runs (JAX
and PyTorch modes of :func:`lasagne_accum.mode` inline it too).

In the C and Numba modes of :func:`lasagne_accum.mode` two rewrites make it a
:class:`LazyStep` instead:

* :func:`to_lazy_step`, before PyTensor inlines anything: the node becomes a
  ``LazyStep`` holding the stepped values' graph as its inner graph, which it
  runs only when the step happens;
* :func:`inplace`, once PyTensor's destroy handler is in place: the
  ``LazyStep`` writes the new values into the states' own buffers (its inner
  graph is compiled with the states as mutable inputs, so the rule runs in
  place) and fills the gradient buffers with zeros. Where the states cannot
  be overwritten (a state that is also an output, say), the node becomes the
  plain ``ifelse`` again.

A non-stepping call then neither computes nor copies anything; PyTensor's
``IfElse`` copies the branch it returns when that is the new values (C), and
the Numba backend computes both branches on every call.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
from pytensor.compile.builders import OpFromGraph
from pytensor.graph.basic import Apply, Constant, Variable
from pytensor.graph.op import Op
from pytensor.graph.traversal import ancestors

from . import source_key

__all__ = ["WindowStep", "window_step", "LazyStep", "to_lazy_step", "inplace",
           "register_numba"]

_registered: set[str] = set()


def _overlaps_another(value, own, arrays) -> bool:
    """Whether `value` shares memory with one of `arrays` and is not exactly `own`.

    A rule's new value may be computed into, or as a view of, a state's buffer:
    before any state is overwritten such a value is taken aside, unless it is
    the state's own buffer as it stands (nothing to copy).
    """
    if (value.__array_interface__["data"][0] == own.__array_interface__["data"][0]
            and value.shape == own.shape and value.strides == own.strides):
        return False
    return any(np.may_share_memory(value, a) for a in arrays)


class WindowStep(OpFromGraph):
    """``ifelse(keep, states, stepped)`` as one node (see the module notes).

    Inputs: ``keep``, the states, then what the stepped values read besides
    them. Outputs: the states (``keep``) or the stepped values.
    """


def _as_list(outputs: Any) -> list[Variable]:
    """One or several outputs (``ifelse`` and ops return a variable for one) as a list."""
    return list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]


def _cut(stepped: Sequence[Variable], computed: set) -> list[Variable]:
    """What the graph of `stepped` reads: variables in `computed`, or roots that are not constants."""
    return [v for v in ancestors(stepped, blockers=computed)
            if v in computed or (v.owner is None and not isinstance(v, Constant))]


def window_step(keep: Variable, states: Sequence[Variable], stepped: Sequence[Variable],
                computed: Sequence[Variable] = ()) -> list[Variable]:
    """``ifelse(keep, states, stepped)``, built as a :class:`WindowStep` node.

    Parameters
    ----------
    keep : symbolic bool scalar
        True on the calls that do not step.
    states : list of variables
        What each output is when `keep` holds: the updated shared variables,
        and the gradient buffers' sums of this call.
    stepped : list of variables
        What each output is on a step (the rule's new values, zeros for the
        buffers).
    computed : list of variables
        Values the calls that do not step compute anyway (the window's
        counters): the node takes them as inputs instead of computing them
        again on a step.

    Returns
    -------
    list of variables
        One per state.
    """
    from .compat import ifelse

    states, stepped = list(states), list(stepped)
    outer = set(ancestors([keep, *states, *computed]))
    reads = [v for v in _cut(stepped, outer) if v not in states and v is not keep]
    inputs = [keep, *dict.fromkeys(states), *reads]
    chosen = _as_list(ifelse(keep, states, stepped))
    op = WindowStep(inputs, chosen, inline=True, name="lasagne_accum.window_step")
    return _as_list(op(*inputs))


def _is_zeros(v) -> bool:
    """``v`` is a constant zero or an ``Alloc`` of one (``pt.zeros(shape)``)."""
    from pytensor.tensor.basic import Alloc

    from .gemm import is_scalar_zero

    if isinstance(v, Constant):
        return bool(np.all(np.asarray(v.data) == 0))
    return v.owner is not None and isinstance(v.owner.op, Alloc) and is_scalar_zero(
        v.owner.inputs[0])


def _inner_ifelse(fgraph):
    """The ``IfElse`` node of a window step's inner graph `fgraph`, or None."""
    from .compat import IfElse

    owners = {o.owner for o in fgraph.outputs}
    if len(owners) != 1:
        return None
    (node,) = owners
    if node is None or not isinstance(node.op, IfElse) or list(node.outputs) != list(
            fgraph.outputs):
        return None
    return node


class LazyStep(Op):
    """Run an inner graph only when a condition holds, and hand on or update the states.

    ``LazyStep(cond, *states, *others)`` returns the states. When `cond`
    holds, the inner graph computes ``new_i = f_i(states, others)`` for the
    states not in `zeros`, and the `zeros` states become zeros; otherwise
    nothing runs and the states come back unchanged (as views).

    With ``inplace=True`` output ``i`` is state ``i``'s buffer
    (``destroy_map``): the new values are written into the states' buffers
    (the inner graph may compute them there directly: its state inputs are
    mutable), then the `zeros` states are filled with zeros, so neither case
    copies. With ``inplace=False`` a step returns new arrays.

    Parameters
    ----------
    fgraph : FunctionGraph
        The inner graph: inputs are the states, then the other values it
        reads; outputs are the new values of the states not in `zeros`, in
        the states' order.
    n_states : int
        How many of the inputs are states.
    zeros : tuple of int
        The states whose new value is zeros.
    inplace : bool
        Write into the states' buffers.

    Examples
    --------
    >>> import numpy as np, pytensor, pytensor.tensor as pt
    >>> from pytensor.graph.fg import FunctionGraph
    >>> s_in, g_in = pt.vector("s"), pt.vector("g")
    >>> op = LazyStep(FunctionGraph([s_in, g_in], [s_in - g_in], clone=False), 1)
    >>> cond, s, g = pt.scalar("cond", dtype="bool"), pt.vector("s"), pt.vector("g")
    >>> f = pytensor.function([cond, s, g], op(cond, s, g), mode="FAST_COMPILE")
    >>> f(False, np.ones(2), np.full(2, 0.25))
    array([1., 1.])
    >>> f(True, np.ones(2), np.full(2, 0.25))
    array([0.75, 0.75])
    """

    __props__ = ()

    def __init__(self, fgraph, n_states: int, zeros: Sequence[int] = (), inplace: bool = False):
        self.fgraph = fgraph
        self.n_states = n_states
        self.zeros = tuple(sorted(zeros))
        self.computed = tuple(i for i in range(n_states) if i not in self.zeros)
        self.inplace = inplace
        if inplace:
            self.destroy_map = {i: [1 + i] for i in range(n_states)}
        else:
            self.view_map = {i: [1 + i] for i in range(n_states)}
        self._fn: Any = None

    def __eq__(self, other):
        return self is other

    def __hash__(self):
        return id(self)

    def __str__(self):
        zeros = f", {len(self.zeros)} zeroed" if self.zeros else ""
        where = ", inplace" if self.inplace else ""
        return f"LazyStep{{{self.n_states} states{zeros}{where}}}"

    def make_node(self, cond, *inputs):
        states = inputs[:self.n_states]
        return Apply(self, [cond, *inputs], [s.type() for s in states])

    def with_inplace(self) -> LazyStep:
        """The same step, writing into the states' buffers."""
        return LazyStep(self.fgraph, self.n_states, self.zeros, inplace=True)

    def inner_function(self):
        """The inner graph compiled for the C backends (states mutable when in place).

        Compiled by PyTensor's Numba backend when numba imports (its fused
        elementwise loops run an update rule faster than the C backend's),
        else by the C backend; both in :func:`lasagne_accum.mode`.
        """
        if self._fn is None:
            import importlib.util

            import pytensor
            from pytensor.compile.io import In, Out

            from .modes import build

            fg = self.fgraph.clone()
            float16 = any(getattr(v.type, "dtype", "") == "float16"
                          for v in [*fg.inputs, *fg.outputs])   # Numba compiles no float16
            base = "NUMBA" if importlib.util.find_spec("numba") and not float16 else "CVM"
            ins = [In(v, borrow=True, mutable=self.inplace and i in self.computed)
                   for i, v in enumerate(fg.inputs)]
            self._fn = pytensor.function(ins, [Out(o, borrow=True) for o in fg.outputs],
                                         mode=build(base), accept_inplace=True,
                                         on_unused_input="ignore")
            self._fn.trust_input = True
        return self._fn

    def prepare_node(self, node, storage_map, compute_map, impl):
        if impl != "numba":  # compile now, with the outer function, not at the first step
            self.inner_function()

    def perform(self, node, inputs, output_storage):
        cond, args = inputs[0], inputs[1:]
        states = args[:self.n_states]
        if not cond:
            for out, s in zip(output_storage, states):
                out[0] = s
            return
        new = list(self.inner_function()(*args))
        if self.inplace:
            # a new value in (or a view of) a state's buffer goes aside before any store
            for k, (i, v) in enumerate(zip(self.computed, new)):
                if _overlaps_another(v, states[i], states):
                    new[k] = v.copy()
            for i, v in zip(self.computed, new):
                if v is not states[i] and not (
                        v.__array_interface__["data"][0] == states[i].__array_interface__[
                            "data"][0] and v.strides == states[i].strides):
                    np.copyto(states[i], v)
            for i in self.zeros:
                states[i].fill(0)
            for out, s in zip(output_storage, states):
                out[0] = s
            return
        values = dict(zip(self.computed, new))
        for i, out in enumerate(output_storage):
            if i in values:
                v = values[i]
                # an output must not share memory with an input it is not a view of
                out[0] = v.copy() if any(np.may_share_memory(v, a) for a in args) else v
            else:
                out[0] = np.zeros_like(states[i])


def to_lazy_step():
    """The rewrite: a :class:`WindowStep` node -> a :class:`LazyStep` (not in place yet)."""
    import pytensor.tensor as pt
    from pytensor.graph.fg import FunctionGraph
    from pytensor.graph.rewriting.basic import dfs_rewriter, node_rewriter

    from .compat import mutable_graph

    @node_rewriter([WindowStep])
    def local_window_step_to_lazy_step(fgraph, node):
        fg = mutable_graph(node.op.fgraph)
        ifelse_node = _inner_ifelse(fg)
        if ifelse_node is None:
            return None
        n = ifelse_node.op.n_outs
        inner_inputs = list(fg.inputs)
        states, stepped = ifelse_node.inputs[1:1 + n], ifelse_node.inputs[1 + n:]
        if list(states) != inner_inputs[1:1 + n] or ifelse_node.inputs[0] is not inner_inputs[0]:
            return None  # not what window_step builds
        zeros = [i for i, v in enumerate(stepped) if _is_zeros(v)]
        new_values = [v for i, v in enumerate(stepped) if i not in zeros]
        inner = FunctionGraph(inner_inputs[1:], new_values, clone=True)
        lazy = LazyStep(inner, n, zeros)
        outs = _as_list(lazy(pt.eq(node.inputs[0], 0), *node.inputs[1:]))
        return [o if o.type == old.type else old.type.filter_variable(o)
                for o, old in zip(outs, node.outputs)]

    return dfs_rewriter(local_window_step_to_lazy_step)


def _as_ifelse(node) -> list[Variable]:
    """A :class:`LazyStep` node's outputs written as the plain ``ifelse``."""
    import pytensor.tensor as pt
    from pytensor.graph.replace import clone_replace

    from .compat import ifelse

    op = node.op
    cond, args = node.inputs[0], node.inputs[1:]
    states = list(args[:op.n_states])
    new = clone_replace(list(op.fgraph.outputs), replace=dict(zip(op.fgraph.inputs, args)))
    values = dict(zip(op.computed, new))
    stepped = [values[i] if i in values else pt.zeros_like(states[i])
               for i in range(op.n_states)]
    return _as_list(ifelse(pt.eq(cond, 0), states, stepped))


def inplace():
    """The rewrite: each :class:`LazyStep` writes into its states, or becomes ``ifelse``.

    Needs PyTensor's destroy handler (its in-place passes): the replacement
    is validated by it, and where it is refused, or the mode has no in-place
    passes, the node becomes the plain ``ifelse`` (correct everywhere, the
    Numba backend included).
    """
    from pytensor.graph.fg import Output
    from pytensor.graph.rewriting.basic import GraphRewriter
    from pytensor.graph.utils import InconsistencyError

    def may_overwrite(fgraph, state):
        """A shared variable's value, or a value computed in the call that no output shows."""
        if state in fgraph.inputs:
            return True
        return state.owner is not None and not any(
            isinstance(client.op, Output) for client, _ in fgraph.clients[state])

    class LazyStepInplace(GraphRewriter):
        def add_requirements(self, fgraph):
            pass

        def apply(self, fgraph):
            for node in list(fgraph.toposort()):
                if not isinstance(node.op, LazyStep) or node.op.inplace:
                    continue
                op = node.op
                states = node.inputs[1:1 + op.n_states]
                if (hasattr(fgraph, "destroyers") and len(set(states)) == op.n_states
                        and all(may_overwrite(fgraph, s) for s in states)):
                    new = op.with_inplace().make_node(*node.inputs).outputs
                    try:
                        fgraph.replace_all_validate(list(zip(node.outputs, new)),
                                                    reason="lasagne_accum_lazy_step_inplace")
                        continue
                    except InconsistencyError:
                        pass
                fgraph.replace_all(list(zip(node.outputs, _as_ifelse(node))),
                                   reason="lasagne_accum_lazy_step_inplace")

    return LazyStepInplace()


def register_numba():
    """Numba code of the in-place :class:`LazyStep` (once; imports numba).

    The inner graph is compiled by the Numba backend and called behind an
    ``if`` in the outer function's code; its results are stored into the
    states' buffers unless the inner graph wrote them there already.
    """
    if "numba" in _registered:
        return
    from hashlib import sha256

    from pytensor.compile.aliasing import add_supervisor_to_fgraph, insert_deepcopy
    from pytensor.compile.io import In, Out
    from pytensor.compile.mode import NUMBA
    from pytensor.link.numba.cache import compile_numba_function_src
    from pytensor.link.numba.dispatch import basic as numba_basic
    from pytensor.link.numba.dispatch.basic import (
        numba_funcify_and_cache_key,
        register_funcify_and_cache_key,
    )

    @numba_basic.numba_njit
    def bounds(a):
        """The lowest and one past the highest byte address `a` spans."""
        lo = hi = a.ctypes.data
        for extent, stride in zip(a.shape, a.strides):
            if extent == 0:
                return lo, lo
            if stride < 0:
                lo += (extent - 1) * stride
            else:
                hi += (extent - 1) * stride
        return lo, hi + a.itemsize

    @numba_basic.numba_njit
    def aside(value, own, spans):
        """`value`, or a copy where it shares memory with a state and is not `own` itself."""
        if value.ctypes.data == own.ctypes.data and value.shape == own.shape and \
                value.strides == own.strides:
            return value
        lo, hi = bounds(value)
        for other_lo, other_hi in spans:
            if lo < other_hi and other_lo < hi:
                return value.copy()
        return value

    @numba_basic.numba_njit
    def store0(dst, src):
        if dst.ctypes.data != src.ctypes.data:
            dst[()] = src[()]

    @numba_basic.numba_njit
    def store(dst, src):
        if dst.ctypes.data != src.ctypes.data or dst.strides != src.strides:
            dst[...] = src

    @register_funcify_and_cache_key(LazyStep)
    def numba_funcify_LazyStep(op, node=None, **kwargs):
        if not op.inplace:
            raise NotImplementedError("LazyStep reaches the Numba backend in place only")
        kwargs.pop("storage_map", None)
        fgraph = op.fgraph.clone()
        specs = [In(v, borrow=True, mutable=i in op.computed)
                 for i, v in enumerate(fgraph.inputs)]
        add_supervisor_to_fgraph(fgraph=fgraph, input_specs=specs, accept_inplace=True)
        NUMBA.optimizer(fgraph)
        insert_deepcopy(fgraph, wrapped_inputs=specs,
                        wrapped_outputs=[Out(o, borrow=True) for o in fgraph.outputs])
        inner, inner_key = numba_funcify_and_cache_key(
            fgraph, squeeze_output=False, fgraph_name="lazy_step_inner", **kwargs)
        n = op.n_states
        args = [f"a{i}" for i in range(len(fgraph.inputs))]
        # in place, a new value may lie in (or be a view of) a state's buffer: take
        # those values aside (aside) before any store; the zeroed states' fills come last
        lines = ["    if cond:"]
        if op.computed:
            spans = ", ".join(f"bounds(a{i})" for i in range(n)) + ("," if n == 1 else "")
            lines += [f"        new = inner({', '.join(args)})",
                      f"        spans = ({spans})"]
            lines += [f"        n{i} = aside(new[{k}], a{i}, spans)"
                      for k, i in enumerate(op.computed)]
            lines += [f"        store{'0' if fgraph.inputs[i].type.ndim == 0 else ''}(a{i}, n{i})"
                      for i in op.computed]
        lines += [f"        a{i}[{'()' if fgraph.inputs[i].type.ndim == 0 else '...'}] = 0"
                  for i in op.zeros]
        returns = ", ".join(args[:n]) + ("," if n == 1 else "")
        src = (f"def lazy_step(cond, {', '.join(args)}):\n" + "\n".join(lines) + "\n"
               f"    return {args[0] if n == 1 else returns}\n")
        fn = numba_basic.numba_njit(compile_numba_function_src(
            src, "lazy_step", {"inner": inner, "store": store, "store0": store0, "aside": aside,
                               "bounds": bounds}))
        own = source_key(__file__)
        key = None if inner_key is None else sha256(
            str(("lasagne_accum.LazyStep", n, op.zeros, inner_key, own)).encode()).hexdigest()
        return fn, key

    _registered.add("numba")
