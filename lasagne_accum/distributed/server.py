"""The parameter server: routing and checks shared by both backends, and the in-process server.

:class:`BaseServer` checks a push once (names, shapes, dtypes, finiteness,
ids, versions), splits it by shard and hands it to the backend, which pushes
it to all its shards atomically (:func:`~lasagne_accum.distributed.shard.push_atomic`
in this process; :mod:`lasagne_accum.distributed.dask` across processes).
:class:`ParameterServer` holds its shards in this process, for threads.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Callable, Sequence

from ..checkpoint import read_arrays, save_arrays
from .checks import check_grads, check_names, check_seq, check_shard_name, check_version, \
    check_weight, check_worker_id, named_params, param_specs, plan_shards
from .errors import PushRejected, ServerClosedError
from .options import ServerOptions
from .shard import Shard, push_atomic, unregister_atomic

if TYPE_CHECKING:
    import numpy as np
    from pytensor.compile.sharedvalue import SharedVariable

    from .._typing import PathLike, UpdateRule

__all__ = ["BaseServer", "ParameterServer"]


class BaseServer:
    """Routing and validation shared by the in-process and Dask servers.

    Subclasses set ``self.options`` and call :meth:`_setup`, and implement
    ``_call(indices, method, args_list)`` (run ``shard.method(*args)`` on
    each shard index and return the results, or raise the first error),
    ``_push(indices, calls, pull, wait)`` (push to those shards atomically;
    in sync mode with `wait`, each shard's result is its round's result) and
    ``_note_rejected()`` (count one rejected push).
    """

    _copy_grads = True        # a push's arrays are copied when checked (a server keeps them)

    def _finite_checked_here(self, idx):
        """The shards among `idx` whose gradients this process refuses for NaN or inf (a
        shard in another process refuses them there)."""
        return set(idx) if self.options.check_finite else set()

    # implemented by the subclasses
    _call: Callable[..., list[Any]]
    _push: Callable[..., list[Any]]
    _note_rejected: Callable[[], None]

    def _setup(self, named, shards, options):
        self.options = options
        self.specs = param_specs(named)
        self.plan = plan_shards(self.specs, shards)
        self.shard_names = tuple(self.plan)
        self.names = tuple(self.specs)
        self._shard_of = {n: i for i, group in enumerate(self.plan.values()) for n in group}
        self._shard_specs = [OrderedDict((n, self.specs[n]) for n in group)
                             for group in self.plan.values()]

    @property
    def mode(self) -> str:
        return self.options.mode

    @property
    def merge(self) -> str:
        return self.options.merge

    # ------------------------------------------------------------ routing

    def _all(self):
        return list(range(len(self.shard_names)))

    def _targets(self, shards):
        if shards is None:
            return self._all()
        if isinstance(shards, str):
            shards = [shards]
        return sorted({self.shard_names.index(check_shard_name(s, self.shard_names))
                       for s in shards})

    def register(
        self,
        worker_id: str | int,
    ) -> tuple[tuple[int | None, ...], dict[str, np.ndarray]]:
        """Register a worker on every shard; return ``(version, {name: array})``."""
        check_worker_id(worker_id)
        results = self._call(self._all(), "register", [(worker_id,)] * len(self.plan))
        return self._combine(results)

    def next_seq(self, worker_id: str | int) -> int:
        """The first seq that no shard has applied for `worker_id` (a new worker process with
        an old id, after a restart from a checkpoint, numbers its pushes from here)."""
        check_worker_id(worker_id)
        return max(self._call(self._all(), "next_seq", [(worker_id,)] * len(self.plan)))

    def unregister(self, worker_id: str | int) -> bool:
        """Remove a worker from every shard's live set (a sync round may close)."""
        results = self._call(self._all(), "unregister", [(worker_id,)] * len(self.plan))
        return any(results)

    def pull(
        self,
        shards: str | Sequence[str] | None = None,
    ) -> tuple[tuple[int | None, ...], dict[str, np.ndarray]]:
        """``(version, {name: array})``; `version` is a tuple, one entry per shard.

        With `shards` (names), only those shards' params; other version
        entries are None.
        """
        idx = self._targets(shards)
        results = self._call(idx, "pull", [()] * len(idx))
        return self._combine(results, idx)

    def _combine(self, results, idx=None):
        idx = self._all() if idx is None else idx
        version = [None] * len(self.plan)
        values = {}
        for i, (v, arrays) in zip(idx, results):
            version[i] = v
            values.update(arrays)
        return tuple(version), {n: values[n] for n in self.names if n in values}

    def _check_push(self, worker_id, seq, grads, weight, version, shards):
        """``(indices, calls)`` of a valid push; PushRejected otherwise."""
        idx = self._targets(shards)
        if self.mode == "sync" and len(idx) != len(self.plan):
            raise PushRejected("sync mode: a push must cover every shard")
        check_worker_id(worker_id)
        seq = check_seq(seq)
        weight = check_weight(weight)
        if isinstance(version, Mapping):
            version = tuple(version.get(s) for s in self.shard_names)
        if not isinstance(version, (tuple, list)) or len(version) != len(self.plan):
            raise PushRejected(f"version must be the tuple of {len(self.plan)} shard versions "
                               f"returned by pull() or register(), got {version!r}")
        check_names(grads, self.names)
        outside = [k for k in grads if self._shard_of[k] not in idx]
        if outside:
            raise PushRejected(f"gradient for {', '.join(map(repr, outside))} whose shard "
                               "this push does not target")
        calls, finite_here = [], self._finite_checked_here(idx)
        for i in idx:
            specs = self._shard_specs[i]
            where = f"shard {self.shard_names[i]!r}"
            arrays = check_grads({n: grads[n] for n in specs if n in grads}, specs, where,
                                 i in finite_here, copy=self._copy_grads)
            calls.append((worker_id, seq, arrays, weight, check_version(version[i], where)))
        return idx, calls

    def push(
        self,
        worker_id: str | int,
        seq: int,
        grads: Mapping[str, Any],
        weight: float = 1.0,
        version: Sequence[int | None] | Mapping[str, int | None] | None = None,
        *,
        shards: str | Sequence[str] | None = None,
        wait: bool = True,
        pull: bool = False,
    ) -> dict[str, Any]:
        """Push one worker's gradients to their shards, all or nothing.

        Parameters
        ----------
        worker_id : str or int
            A registered worker.
        seq : int
            The worker's push counter; a retry with the same ``(worker_id,
            seq)`` is applied once.
        grads : dict
            ``{parameter name: array}``: every parameter of the target shards,
            each of the parameter's shape and dtype.
        weight : float
            Examples behind the gradient: its weight in the sync mean.
        version : tuple of int
            The version from the :meth:`pull` the gradient was computed from.
        shards : list of str, optional
            Async mode: push to these shards only (default all).
        wait : bool
            Sync mode: return when the round has closed (default). False:
            return at once (the ``round`` entries say what to wait for).
        pull : bool
            Also return the target shards' parameters after the push (and
            after the round, in sync mode) as ``params``.

        Returns
        -------
        dict
            ``applied`` (this call applied the push, or its round closed
            with it), ``duplicate`` (a retry of an applied or queued push:
            not applied again; of two simultaneous identical pushes exactly
            one reports ``applied``), ``staleness`` (the largest over the
            shards; async), ``version`` (tuple after the push), ``shards``
            (per-shard results; in sync mode with `wait`, the round's result:
            merged ``workers``, ``timed_out``, ``dropped``).

        Raises
        ------
        PushRejected, UnknownWorkerError, StalePushError
            Bad input; every shard was checked first, so nothing was applied
            or queued anywhere. Counted once in ``stats()["rejected"]``.
        RoundFailedError
            The step (async) or the round (sync) could not be applied
            (the compiled step raised, a round timed out with
            ``on_timeout="fail"``), or was refused because it would write
            NaN or inf (:class:`~lasagne_accum.distributed.NonFiniteStepError`,
            with ``check_finite``). A failed sync round applied nothing
            (nor, with ``check_finite``, did the rounds it closed with on
            the other shards of its process). A failed async step applied
            nothing on its shard; with ``check_finite`` (the default) nor on
            the other shards of its process, but shards that other
            processes hold, or (without ``check_finite``) the shards the
            push reached before it, may have applied it: send the same
            ``(worker_id, seq)`` again to complete it.
        ServerTimeoutError
            Waited ``wait_timeout`` seconds for a round or a shard.
        """
        try:
            idx, calls = self._check_push(worker_id, seq, grads, weight, version, shards)
            results = self._push(idx, calls, pull, wait)
        except PushRejected:
            self._note_rejected()
            raise
        out_version = [None] * len(self.plan)
        per = OrderedDict()
        for i, r in zip(idx, results):
            per[self.shard_names[i]] = r
            out_version[i] = r["version"]
        first = results[0]
        if self.mode == "sync" and wait:
            applied = not first["duplicate"]
        else:
            applied = bool(first["applied"])
        stal = [r["staleness"] for r in results if r.get("staleness") is not None]
        out = dict(applied=applied, duplicate=bool(first["duplicate"]),
                   staleness=max(stal) if stal else None, shards=per)
        if pull:
            params = {}
            missing = [i for i in idx if "params" not in per[self.shard_names[i]]]
            for i in idx:
                params.update(per[self.shard_names[i]].pop("params", {}))
            if missing:
                for i, (v, arrays) in zip(missing, self._call(missing, "pull",
                                                              [()] * len(missing))):
                    params.update(arrays)
                    out_version[i] = v
            out["params"] = {n: params[n] for n in self.names if n in params}
        out["version"] = tuple(out_version)
        return out

    def stats(self) -> dict[str, Any]:
        """Per-shard counters and totals.

        ``applied`` is the number of pushes every shard has applied (merged
        in sync mode); ``rejected`` the rejected pushes (each counted once);
        ``version`` the tuple of shard versions.
        """
        per = self._call(self._all(), "stats", [()] * len(self.plan))
        hist: dict[Any, int] = {}
        for s in per:
            for k, c in s["staleness"].items():
                hist[k] = hist.get(k, 0) + c
        return dict(
            mode=self.mode, version=tuple(s["version"] for s in per),
            applied=min(s["applied"] for s in per),
            rounds=min(s["rounds"] for s in per),
            timeouts=max(s["timeouts"] for s in per),
            failed_rounds=max(s["failed_rounds"] for s in per),
            received=max(s["received"] for s in per),
            duplicates=max(s["duplicates"] for s in per),
            rejected=sum(s["rejected"] for s in per),
            bytes=sum(s["bytes"] for s in per),
            examples=max(s["examples"] for s in per),
            staleness=dict(sorted(hist.items())),
            live_workers=per[0]["live_workers"],
            shards=dict(zip(self.shard_names, per)),
        )

    def state(self) -> OrderedDict[str, np.ndarray]:
        """``{name: array}`` of every shard: params, rule state, counters, applied seqs."""
        merged = OrderedDict()
        for part in self._call(self._all(), "state", [()] * len(self.plan)):
            for n, a in part.items():
                if n in merged:
                    raise ValueError(f"two shards hold state named {n!r}; rename it")
                merged[n] = a
        return merged

    def averages(self) -> dict[str, dict[str, np.ndarray]]:
        """The averages the shards keep (``model_average=``, ``ema=``): ``{kind: {name: array}}``.

        A kind is present once each of its shards has taken a step.
        """
        merged: dict[str, dict[str, np.ndarray]] = {}
        parts = self._call(self._all(), "averages", [()] * len(self.plan))
        for kind in ("model_average", "ema"):
            if parts and all(kind in part for part in parts):
                merged[kind] = {n: a for part in parts for n, a in part[kind].items()}
        return merged

    def save(self, path: PathLike) -> list[str]:
        """Checkpoint params, rule state, counters and each worker's applied seqs (atomic).

        Written with :func:`lasagne_accum.checkpoint.save_arrays`; parameters keep
        their names, so ``load_state(path, my_params, strict=False)`` reads
        them into a single-process model. Returns the names written.
        """
        return save_arrays(path, self.state())

    def load(self, path: PathLike) -> list[str]:
        """Restore a checkpoint written by :meth:`save` (same params, shards and rule).

        Every name, shape and dtype is checked (from the file's headers)
        before anything is set. Registrations are kept; the record of
        applied ``(worker, seq)`` ids becomes the checkpoint's, so a retry of
        a push the checkpoint includes is not applied again.
        """
        parts = self._call(self._all(), "state_specs", [()] * len(self.plan))
        expected, optional = OrderedDict(), []
        for part in parts:
            for n, spec in part.items():
                expected[n] = spec
                if spec[0] is None:
                    optional.append(n)
        arrays = read_arrays(path, expected, optional=optional)
        self._call(self._all(), "load", [({n: arrays[n] for n in part if n in arrays},)
                                         for part in parts])
        return list(arrays)

    closed = False

    def last_timing(self) -> dict[str, float] | None:
        """Where this thread's last call spent its time, for servers that send messages
        (``{"serialise", "shard", "round"}`` seconds); None for the in-process server."""
        return None

    def close(self) -> None:
        """Close the server: later calls on it raise ``ServerClosedError``.

        ``ParameterServer`` holds nothing else to free; a Dask server
        releases its shard actors (their state is lost: :meth:`save` first).
        """
        self.closed = True

    def _check_open(self) -> None:
        if self.closed:
            raise ServerClosedError(f"this {type(self).__name__} was closed: its calls are "
                                    "refused (make a new server, or load a checkpoint into one)")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class ParameterServer(BaseServer):
    """A parameter server in this process: shards with locks, for threads.

    Parameters
    ----------
    params : dict or list
        ``{name: ndarray}`` (the server keeps copies), or a list of named
        shared variables (used as they are: the server updates them in place).
    update_rule : callable
        Any rule ``update_rule(grads, params, **rule_kwargs)``; it is called
        once per shard, so per-shard step counters (``adam.t``) make a split
        Adam exactly Adam in sync mode.
    rule_kwargs : dict, optional
        Hyperparameters; ``learning_rate`` may be a number, a shared variable
        or a schedule (:mod:`lasagne_accum.schedules`, or any callable of the
        symbolic step), compiled into each shard's rule with the shard's own
        step counter (``<shard>/schedule_step``, saved in checkpoints).
    shards : None, list of lists, or dict
        None: one shard per parameter. Else groups of parameter names (a rule
        that couples parameters, like a global norm clip, needs them in one
        shard).
    options : ServerOptions, optional
    **option_kwargs
        ``mode``, ``merge``, ``staleness_scale``, ``round_timeout``,
        ``on_timeout``, ``compile_mode``, ``check_finite``, ``keep_log``,
        ``wait_timeout``: see :class:`~lasagne_accum.distributed.options.ServerOptions`.

    Examples
    --------
    >>> import numpy as np
    >>> from lasagne_accum import sgd
    >>> server = ParameterServer({"w": np.zeros(2)}, sgd, dict(learning_rate=0.5),
    ...                          mode="async", compile_mode="FAST_COMPILE")
    >>> version, params = server.register("a")
    >>> r = server.push("a", 0, {"w": np.array([1.0, 2.0])}, version=version)
    >>> server.pull()
    ((1,), {'w': array([-0.5, -1. ])})
    >>> server.push("a", 0, {"w": np.array([1.0, 2.0])}, version=version)["duplicate"]
    True
    """

    def __init__(
        self,
        params: Mapping[str, SharedVariable] | Sequence[SharedVariable],
        update_rule: UpdateRule,
        rule_kwargs: Mapping[str, Any] | None = None,
        *,
        shards: Sequence[Sequence[str]] | Mapping[str, Sequence[str]] | None = None,
        options: ServerOptions | None = None,
        **option_kwargs: Any,
    ) -> None:
        options = ServerOptions.of(options, **option_kwargs)
        named = named_params(params)
        self._setup(named, shards, options)
        self.shards = [Shard(s, OrderedDict((n, named[n]) for n in group), update_rule,
                             rule_kwargs, options) for s, group in self.plan.items()]

    def _call(self, indices, method, args_list):
        self._check_open()
        return [getattr(self.shards[i], method)(*args) for i, args in zip(indices, args_list)]

    def _push(self, indices, calls, pull, wait):
        self._check_open()
        shards = [self.shards[i] for i in indices]
        waits = self.mode == "sync" and wait      # the round's result brings the params
        results = push_atomic(shards, calls, pull=pull and not waits)
        if not waits:
            return results
        out = []
        for shard, r in zip(shards, results):
            if r.get("round") is None:          # a retry of a push whose round is gone
                out.append(r)
                continue
            info = shard.wait_round(r["round"], pull=pull)
            out.append(dict(info, duplicate=r["duplicate"]))
        return out

    def _note_rejected(self):
        self.shards[0].note_rejected()

    def unregister(self, worker_id: str | int) -> bool:
        """Remove a worker from every shard's live set; the sync rounds this closes are taken
        on every shard or on none (see :func:`~lasagne_accum.distributed.shard.push_atomic`)."""
        self._check_open()
        return any(unregister_atomic(self.shards, worker_id))
