"""The trainer side: a :class:`Worker` pulls, computes gradients, pushes; and what both runners share."""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence

import numpy as np

from ..accumulate import accumulate_gradients
from ..batch_norm import batch_norm_layers
from ..training import AccumulationTrainer
from .._checks import check_int
from .checks import aligned, check_worker_id, param_specs
from .compiling import compile_function

if TYPE_CHECKING:
    from .server import BaseServer

__all__ = ["Worker", "model_spec", "worker_lists", "raise_worker_errors"]


def model_spec(built):
    """``(inputs, loss, params, weight)`` from what a ``build_model`` returned."""
    if isinstance(built, Mapping):
        inputs, loss, params = built["inputs"], built["loss"], built["params"]
        weight = built.get("weight")
    elif isinstance(built, (tuple, list)) and len(built) in (3, 4):
        inputs, loss, params = built[:3]
        weight = built[3] if len(built) == 4 else None
    else:
        raise TypeError("build_model() must return (inputs, loss, params), (inputs, loss, "
                        "params, weight) or a dict with those keys")
    inputs = list(inputs)
    if weight is None:
        weight = inputs[0].shape[0]       # examples in the batch
    return inputs, loss, list(params), weight


def worker_lists(worker_batches, ids=None):
    """The runners' shared set-up: the batch lists and ``worker0, worker1...`` ids, checked."""
    worker_batches = list(worker_batches)
    ids = list(ids) if ids is not None else [f"worker{k}" for k in range(len(worker_batches))]
    if len(ids) != len(worker_batches):
        raise ValueError(f"{len(ids)} worker ids for {len(worker_batches)} batch lists")
    for wid in ids:
        check_worker_id(wid)
    return worker_batches, ids


def raise_worker_errors(ids, errors):
    """The runners' shared error report: RuntimeError naming the first failed worker."""
    for wid, exc in zip(ids, errors):
        if exc is not None:
            raise RuntimeError(f"worker {wid!r} failed: {type(exc).__name__}: {exc}") from exc


class Worker:
    """A trainer: pulls params, computes gradients on its batches, pushes them.

    Parameters
    ----------
    server : ParameterServer or DaskParameterServer
    worker_id : str or int
    build_model : callable
        ``build_model(**model_kwargs)`` returning ``(inputs, loss, params)``
        (or with a 4th element, the batch's weight; default: the first
        input's length). Param names must match the server's. Called in the
        worker (each worker compiles its own function: a compiled function
        is never shared between threads). With Dask it must be picklable: a
        module-level function.
    accumulate : int
        Batches whose gradients are accumulated locally (weighted by batch
        size) before one push: N times less traffic.
    model_kwargs : dict, optional
    compile_mode : str, optional
        PyTensor mode of both functions (default:
        :func:`lasagne_accum.default_modes`).
    """

    def __init__(
        self,
        server: BaseServer,
        worker_id: str | int,
        build_model: Callable[..., Any],
        *,
        accumulate: int = 1,
        model_kwargs: Mapping[str, Any] | None = None,
        compile_mode: str | None = None,
    ) -> None:
        check_worker_id(worker_id)
        self.server, self.worker_id = server, worker_id
        self.accumulate = check_int(accumulate, "accumulate")
        start = time.perf_counter()
        inputs, loss, params, weight = model_spec(build_model(**dict(model_kwargs or {})))
        names = [p.name for p in params]
        specs = param_specs(OrderedDict((p.name, p) for p in params))
        if sorted(specs) != sorted(server.specs):
            raise ValueError(f"worker {worker_id!r}: the model's params {names} do not match "
                             f"the server's {list(server.specs)}")
        for n, spec in specs.items():
            if tuple(spec) != tuple(server.specs[n]):
                raise ValueError(f"worker {worker_id!r}: param {n!r} is {spec} in the model, "
                                 f"{server.specs[n]} on the server")
        self.params = OrderedDict(zip(names, params))
        if batch_norm_layers(loss):
            raise ValueError(
                f"worker {worker_id!r}: the model has batch_norm() layers, which the parameter "
                "server does not handle yet (their running statistics would live in each "
                "trainer, unsaved); train it with compile_accumulation")
        acc = self._accumulation = accumulate_gradients(loss, params, weight=weight)
        self._step = compile_function(inputs, loss, acc.accumulate, compile_mode,
                                      role="accumulate")
        self._read = compile_function([], list(acc.grads) + [acc.total], acc.reset,
                                      compile_mode, role="apply")
        self.compile_seconds = time.perf_counter() - start
        self.seq = 0
        self.version: tuple[int | None, ...] | None = None

    def _set(self, values):
        # a server's reply is this worker's own (fresh arrays, or views of the message it
        # received): kept as it is where it is writeable, copied where it is not
        for n, v in values.items():
            v = aligned(v)
            borrow = isinstance(v, np.ndarray) and v.flags.writeable and v.flags.c_contiguous
            self.params[n].set_value(v, borrow=borrow)

    def run(
        self,
        batches: Iterable[Sequence[Any]],
        *,
        register: bool = True,
        unregister: bool = True,
        start: Callable[[], Any] | None = None,
    ) -> dict[str, Any]:
        """Train on `batches` (tuples of the inputs), pushing every `accumulate` batches.

        A partial window at the end is pushed too. The first batch is run
        once untimed (and its gradient discarded) so that JIT backends
        compile before ``t_start``; `start`, if given, is called after that
        (a barrier, so that timed runs start together). Returns a report:
        pushes, batches, examples, bytes pushed, ``losses`` as ``(wall time,
        loss, examples)``, ``staleness`` per push, start and end wall times,
        ``compute_s`` (seconds in the compiled gradient and read functions),
        ``server_s`` (seconds spent in push calls: transfer, waiting for the
        round, applying), ``push_s`` (each push call's seconds) and, for a
        Dask server with the ``profile`` option, ``parts``: the push calls'
        seconds preparing the requests here (``serialise``), in the shard
        processes (``shard``) and waiting there for sync rounds (``round``);
        the rest is the transport.
        The worker unregisters at the end, also when it fails.
        """
        report: dict[str, Any] = dict(
            worker=self.worker_id, pushes=0, batches=0, examples=0.0, bytes=0, duplicates=0,
            losses=[], staleness=[], compile_s=self.compile_seconds, server_s=0.0, push_s=[],
            compute_s=0.0, parts=dict(serialise=0.0, shard=0.0, round=0.0),
        )
        try:
            if register:
                self.version, values = self.server.register(self.worker_id)
                self.seq = max(self.seq, self.server.next_seq(self.worker_id))
            else:
                self.version, values = self.server.pull()
            self._set(values)
            batches = (tuple(map(aligned, batch)) for batch in batches)
            first = next(batches, None)
            if first is not None:       # JIT backends compile on the first call: not timed
                self._step(*first)
                self._read()
                batches = itertools.chain([first], batches)
            if start is not None:
                start()
            report["t_start"] = time.time()

            def timed_step(*batch):
                begin = time.perf_counter()
                loss = self._step(*batch)
                report["compute_s"] += time.perf_counter() - begin
                return loss

            # the trainer's loop: a push every `accumulate` batches, and the partial window
            loop = AccumulationTrainer(timed_step, lambda: self._push(report),
                                       self._accumulation, self.accumulate)
            for batch in batches:
                loss = loop.step(*batch)
                report["losses"].append((time.time(), float(loss), len(batch[0])))
                report["batches"] += 1
            loop.flush()
            report["t_end"] = time.time()
        finally:
            if unregister:
                try:
                    self.server.unregister(self.worker_id)
                except Exception:     # the server is gone: nothing to tell it
                    pass
        return report

    def _push(self, report):
        begin = time.perf_counter()
        *grads, total = self._read()
        grads = OrderedDict((n, np.asarray(g)) for n, g in zip(self.params, grads))  # no copy
        start = time.perf_counter()
        report["compute_s"] += start - begin
        result = self.server.push(self.worker_id, self.seq, grads, weight=float(total),
                                  version=self.version, pull=True)
        elapsed = time.perf_counter() - start
        report["server_s"] += elapsed
        report["push_s"].append(elapsed)
        timing = self.server.last_timing()
        if timing is not None:
            for part, seconds in timing.items():
                report["parts"][part] += seconds
        self.seq += 1
        report["pushes"] += 1
        report["examples"] += float(total)
        report["bytes"] += sum(np.asarray(g).nbytes for g in grads.values())
        report["duplicates"] += bool(result["duplicate"])
        if result["staleness"] is not None:
            report["staleness"].append(result["staleness"])
        self.version = result["version"]
        self._set(result["params"])
        return result
