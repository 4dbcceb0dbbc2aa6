"""The options of the parameter server, checked once (re-exported by
:mod:`lasagne_accum.distributed`)."""

import dataclasses
from collections.abc import Mapping
from typing import Any

from .._checks import check_number

__all__ = ["ServerOptions", "DaskOptions", "Checkpoint"]

MODES = ("sync", "async")
MERGES = ("mean", "sum")


def _number(value, name, what, error=ValueError, **bounds):
    """:func:`~lasagne_accum._checks.check_number`, its refusal re-raised as `error`.

    The message says what the number is (`what`), after the checker's own.
    """
    try:
        return check_number(value, name, **bounds)
    except (TypeError, ValueError) as exc:
        raise error(f"{exc} ({what})") from None


def _check_seconds(value, name, allow_none=True):
    if value is None and allow_none:
        return None
    what = "a number of seconds" + (", or None" if allow_none else "")
    return _number(value, name, what, low=0, low_open=True)


@dataclasses.dataclass(frozen=True)
class ServerOptions:
    """The options of a parameter server and its shards, checked once.

    Attributes
    ----------
    mode : {"sync", "async"}
        Sync: a round closes when every live worker has pushed and applies
        their merged gradient once. Async: every push is applied on arrival.
    merge : {"mean", "sum"}
        Sync mode: the mean weighted by each push's examples (exactly the
        large-batch gradient) or the plain sum.
    staleness_scale : bool
        Async mode: multiply each step by ``1 / max(1, staleness)``.
    round_timeout : float or None
        Sync mode: seconds after a round's first push before it stops waiting
        for missing workers.
    on_timeout : {"close", "fail"}
        "close": apply the pushes received and drop the missing workers;
        "fail": discard the round, drop them, raise :class:`RoundTimeoutError`.
    compile_mode : str or None
        PyTensor mode of the apply functions (default: see
        :func:`lasagne_accum.default_modes`).
    check_finite : bool
        Reject gradients with NaN or inf, and refuse a step that would write
        NaN or inf into a parameter or the rule's state
        (:class:`~lasagne_accum.distributed.NonFiniteStepError`, naming them
        and the step): the steps of a push, or of the sync rounds it closes,
        on the shards of one process are computed before any is written,
        and taken on all of them or on none, so the parameters keep their
        last finite values. False: no checks, and each step is written in
        place as it is computed (what it writes, NaN included, is kept).
    keep_log : bool
        Keep the order of applied pushes per shard (``stats()["shards"][s]["log"]``).
    profile : bool
        Dask: time each call's parts (preparing the requests here, the shard
        processes' work, waiting for sync rounds); a worker's report then has
        them as ``parts``. Off: no call is timed.
    wait_timeout : float
        The longest any blocking call (push, pull, register, a sync round's
        wait, a Dask gather) waits before :class:`ServerTimeoutError` names
        what it waited for.
    model_average, ema : dict or None
        Keyword arguments of :class:`lasagne_accum.ModelAverage` and
        :class:`lasagne_accum.ExponentialMovingAverage`: each shard keeps the
        average of its parameters over its optimizer steps.

    Examples
    --------
    >>> ServerOptions(mode="async").merge
    'mean'
    >>> ServerOptions(mode="sync", staleness_scale=True)
    Traceback (most recent call last):
    ...
    ValueError: staleness_scale=True only applies to mode='async' (a sync push is never stale)
    """

    mode: str = "sync"
    merge: str = "mean"
    staleness_scale: bool = False
    round_timeout: float | None = None
    on_timeout: str = "close"
    compile_mode: str | None = None
    check_finite: bool = True
    keep_log: bool = False
    profile: bool = False
    wait_timeout: float = 600.0
    model_average: Any = None
    ema: Any = None

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"mode must be 'sync' or 'async', got {self.mode!r}")
        if self.merge not in MERGES:
            raise ValueError(f"merge must be 'mean' or 'sum', got {self.merge!r}")
        if self.staleness_scale and self.mode != "async":
            raise ValueError("staleness_scale=True only applies to mode='async' "
                             "(a sync push is never stale)")
        object.__setattr__(self, "staleness_scale", bool(self.staleness_scale))
        object.__setattr__(self, "round_timeout",
                           _check_seconds(self.round_timeout, "round_timeout"))
        object.__setattr__(self, "wait_timeout",
                           _check_seconds(self.wait_timeout, "wait_timeout", allow_none=False))
        if self.on_timeout not in ("close", "fail"):
            raise ValueError(f"on_timeout must be 'close' or 'fail', got {self.on_timeout!r}")
        for label in ("model_average", "ema"):
            kwargs = getattr(self, label)
            if kwargs is None:
                continue
            if not isinstance(kwargs, Mapping):
                raise TypeError(f"{label} must be a dict of keyword arguments, got "
                                f"{type(kwargs).__name__}")
            taken = {"params", "updates", "is_step", "host_mode"} & set(kwargs)
            if taken:
                raise TypeError(f"{label}: {', '.join(sorted(taken))} are the server's to "
                                "set (each shard averages its own parameters at each of "
                                "its steps); leave them out")
            object.__setattr__(self, label, dict(kwargs))
        if self.compile_mode is not None and not isinstance(self.compile_mode, str):
            raise TypeError(f"compile_mode must be a PyTensor mode name or None, got "
                            f"{self.compile_mode!r}")

    @classmethod
    def fields_of(cls, options=None, **kwargs):
        """The fields that `options` (a :class:`ServerOptions`, a dict of its fields or
        None) and `kwargs` give, as a dict: names checked, values not yet."""
        names = [f.name for f in dataclasses.fields(cls)]
        if options is None:
            base = {}
        elif isinstance(options, cls):
            base = {name: getattr(options, name) for name in names}
        elif isinstance(options, Mapping):
            base = dict(options)
        else:
            raise TypeError("options must be a ServerOptions or a dict of its fields, got "
                            f"{type(options).__name__}")
        twice = sorted(set(base) & set(kwargs))
        if twice:
            raise TypeError(f"{', '.join(twice)} given twice: in options= and as keywords")
        unknown = sorted((set(base) | set(kwargs)) - set(names))
        if unknown:
            raise TypeError(f"unknown server option(s) {', '.join(unknown)}; the options are "
                            f"{', '.join(names)}")
        return {**base, **kwargs}

    @classmethod
    def of(cls, options=None, **kwargs):
        """`options` (a :class:`ServerOptions`, a dict of its fields or None) with `kwargs`
        replaced."""
        if isinstance(options, cls) and not kwargs:
            return options
        return cls(**cls.fields_of(options, **kwargs))


def _grouped(value, cls, name):
    """`value` as a `cls` (None gives the defaults; a dict its keyword arguments)."""
    if value is None:
        return cls()
    if isinstance(value, Mapping):
        return cls(**value)
    if not isinstance(value, cls):
        raise TypeError(f"{name}= takes a {cls.__name__} (or a dict of its fields), got "
                        f"{type(value).__name__}")
    return value


@dataclasses.dataclass(frozen=True)
class DaskOptions:
    """Where :func:`~lasagne_accum.distributed.train` runs with ``backend="dask"``.

    Attributes
    ----------
    address : str or None
        A scheduler to connect to; without it (and without `client`) a
        loopback ``LocalCluster`` is started and closed.
    client : distributed.Client or None
        A client of yours to use (it is not closed).
    security : distributed.security.Security, bool or None
        TLS for the connection to `address` or for the cluster started
        (True: a temporary self-signed one).
    n_dask_workers : int or None
        Processes of the cluster started (default: one per trainer plus
        `shard_processes`).
    shard_processes : int
        Worker processes that hold the shards and run no trainer (a
        process's event loop answers only between its own trainer's compiled
        calls, which hold the GIL); 0 puts the shards beside the trainers.
    """

    address: str | None = None
    client: Any = None
    security: Any = None
    n_dask_workers: int | None = None
    shard_processes: int = 1

    def __post_init__(self):
        n = self.shard_processes
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"shard_processes must be an integer >= 0, got {n!r}")

    @classmethod
    def of(cls, value):
        """`value` (None, a dict or a DaskOptions) as a DaskOptions."""
        return _grouped(value, cls, "dask")


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """Where :func:`~lasagne_accum.distributed.train` saves and resumes the server's state.

    Attributes
    ----------
    to : path or None
        Save the server's state here at the end (and every `every` seconds).
    every : float or None
        Also save while training runs, every this many seconds (atomic), so a
        lost shard process costs at most that much training. Needs `to`.
    resume_from : path or None
        Load the server's state from here before training.
    snapshot_every : float or None
        Keep ``(wall time, version, params)`` in memory every this many
        seconds while training runs: ``TrainResult.history`` (loss-against-time
        curves).
    """

    to: Any = None
    every: float | None = None
    resume_from: Any = None
    snapshot_every: float | None = None

    def __post_init__(self):
        if self.every is not None:
            if self.to is None:
                raise ValueError("Checkpoint(every=...) needs to= (the file to save to)")
            _check_seconds(self.every, "every", allow_none=False)
        if self.snapshot_every is not None:
            _check_seconds(self.snapshot_every, "snapshot_every", allow_none=False)

    @classmethod
    def of(cls, value):
        """`value` (None, a dict or a Checkpoint) as a Checkpoint."""
        return _grouped(value, cls, "checkpoint")
