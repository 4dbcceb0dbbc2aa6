"""Clusters: a loopback ``LocalCluster`` started and closed for you, or a Client of yours.

Importing this module does not import ``distributed``; the functions that
need it do.
"""

import ast
import contextlib
import logging
import sys

__all__ = ["local_cluster", "connect", "require_distributed", "unguarded_line",
           "worker_addresses"]

KEEP_GLIBC_DEFAULT = "MALLOC_TRIM_THRESHOLD_"   # left unset in the worker processes we start

#: Dask settings of the worker processes :func:`local_cluster` starts.
#:
#: * Dask sets ``MALLOC_TRIM_THRESHOLD_`` in its worker processes, which also fixes
#:   glibc's mmap threshold at 128 KiB: every larger array (a training step's
#:   intermediates, a push) is then fresh pages from the kernel, faulted in one by one,
#:   each time. Left unset, glibc reuses freed blocks.
#: * Dask's statistical profiler samples the stack of a running task every 10 ms on the
#:   worker's event loop, which takes the GIL from the trainer between its compiled calls.
#:   The loopback cluster has no dashboard to show the profile: it is off.
#: * Dask's periodic housekeeping runs less often than its defaults, which wake every
#:   process of the cluster many times a second: CPU time taken from the trainers on a
#:   machine with no core to spare, and in a trainer's own process the GIL, taken from
#:   it for each callback. The event-loop tick (20 ms; it only times the loop, to warn
#:   when it was blocked for over ``distributed.admin.tick.limit``, 3 s) runs every
#:   second, the system monitor (500 ms; it feeds the dashboard's charts) every 5 s, the
#:   memory monitor (100 ms; pausing, spilling and restarting at the memory limits)
#:   every 500 ms, and the scheduler's work stealing (100 ms; train() pins its tasks to
#:   their workers) every second.
WORKER_CONFIG = {f"distributed.nanny.pre-spawn-environ.{KEEP_GLIBC_DEFAULT}": None,
                 "distributed.worker.profile.enabled": False,
                 "distributed.admin.tick.interval": "1s",
                 "distributed.admin.system-monitor.interval": "5s",
                 "distributed.worker.memory.monitor-interval": "500ms",
                 "distributed.scheduler.work-stealing-interval": "1s"}


def require_distributed():
    """Dask's ``distributed`` package, or an ImportError that says how to install it."""
    try:
        import distributed
    except ImportError:
        raise ImportError("the dask backend needs Dask's distributed scheduler: "
                          "pip install 'dask[distributed]' (or lasagne_accum[distributed])") \
            from None
    return distributed


def worker_addresses(client):
    """The addresses of the cluster's workers, sorted, asked of the scheduler now.

    ``client.scheduler_info()["workers"]`` is not used: the client refreshes that dict in
    the background with the worker list left out, and a refresh that lands between the
    query and its return gives an empty list (every trainer would look lost). The
    function sent is a lambda, pickled by value: the scheduler need not have this library.
    """
    return client.run_on_scheduler(lambda dask_scheduler: sorted(dask_scheduler.workers))


def _is_main_test(test):
    """Is `test` the expression ``__name__ == "__main__"`` (either way round)?"""
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1
            and isinstance(test.ops[0], ast.Eq)):
        return False
    sides = [test.left, test.comparators[0]]
    return any(isinstance(s, ast.Name) and s.id == "__name__" for s in sides) and any(
        isinstance(s, ast.Constant) and s.value == "__main__" for s in sides)


def unguarded_line(source, line):
    """Is line `line` of the script `source` run at import, outside ``if __name__ == "__main__":``?

    Returns `line` when it is (a process that imports the script runs it),
    None when an ``if __name__ == "__main__":`` block (or a function or class
    body, which import does not run) holds it, or when `source` does not
    parse.
    """
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return None
    for node in ast.walk(tree):
        end = getattr(node, "end_lineno", None)
        if end is None or not node.lineno <= line <= end:
            continue
        if isinstance(node, ast.If) and _is_main_test(node.test) and any(
                stmt.lineno <= line <= stmt.end_lineno for stmt in node.body):
            return None
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            return None
    return line


# The way round both refusals of _check_main_guard().
_ELSEWHERE = ("a cluster started elsewhere: train(..., dask=DaskOptions(address=...)) or "
              "DaskOptions(client=...)")


def _check_main_guard():
    """Refuse to start worker processes from a script's top level without a main guard.

    Dask starts its worker processes with ``multiprocessing`` (``spawn`` by
    default), and each of them imports the ``__main__`` script: a call at the
    script's top level would run again there, start a cluster of its own, and
    fail after pages of tracebacks.
    """
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if main is None or not path:
        return                         # an interactive session or python -c: nothing re-imported
    try:
        import dask

        method = dask.config.get("distributed.worker.multiprocessing-method", "spawn")
    except Exception:
        method = "spawn"
    if method == "fork":
        return
    if path == "<stdin>":
        raise RuntimeError(
            "the Dask backend starts worker processes, and each of them imports the "
            "__main__ script from its file; a script read from standard input (python -) "
            "has none. Save it to a file and run that (with the call to train() or "
            f"local_cluster() under if __name__ == \"__main__\":), or use {_ELSEWHERE}")
    frame = sys._getframe(1)
    while frame is not None and not (frame.f_code.co_name == "<module>"
                                     and frame.f_globals is vars(main)):
        frame = frame.f_back
    if frame is None:
        return
    try:
        with open(path, encoding="utf-8") as f:
            source = f.read()
    except OSError:
        return
    line = unguarded_line(source, frame.f_lineno)
    if line is not None:
        raise RuntimeError(
            f"{path}, line {line}: the Dask backend starts worker processes, and each of "
            "them imports this script, which would start a cluster again. Put the script's "
            "top-level code under a main guard:\n\n"
            "    if __name__ == \"__main__\":\n"
            "        ...  # the call to train() or local_cluster()\n\n"
            f"(or use {_ELSEWHERE})")


@contextlib.contextmanager
def local_cluster(n_workers=2, *, security=None, silence_logs=logging.ERROR, **cluster_kwargs):
    """Start a ``LocalCluster`` of processes on 127.0.0.1; yield a Client; close both.

    One thread per worker process, no dashboard, random loopback ports, and
    the settings of ``WORKER_CONFIG``: Dask's profiler off, glibc's allocator defaults, and
    Dask's periodic housekeeping less often than its defaults (the event-loop
    tick every second, the system monitor every 5 s, the memory monitor every
    500 ms, work stealing every second), which take precedence over the same
    keys of ``dask.config``; `cluster_kwargs` pass on to ``LocalCluster``.
    `security` (a ``distributed.security.Security``, or True for a temporary
    self-signed one, which needs the ``cryptography`` package) turns on TLS.

    Raises
    ------
    RuntimeError
        Called from a script's top level outside ``if __name__ ==
        "__main__":`` (the worker processes would run the script again).
    """
    distributed = require_distributed()
    _check_main_guard()
    import dask

    kwargs = dict(n_workers=n_workers, threads_per_worker=1, processes=True, host="127.0.0.1",
                  dashboard_address=None, worker_dashboard_address=None,
                  scheduler_kwargs={"dashboard_address": "127.0.0.1:0"},
                  security=security, silence_logs=silence_logs)
    kwargs.update(cluster_kwargs)
    with dask.config.set(WORKER_CONFIG):
        cluster = distributed.LocalCluster(**kwargs)
    try:
        client = distributed.Client(cluster, security=cluster.security)
        try:
            yield client
        finally:
            client.close()
    finally:
        cluster.close()


@contextlib.contextmanager
def connect(address, *, security=None):
    """A Client of the scheduler at `address`; closed (not the cluster) on exit."""
    distributed = require_distributed()
    client = distributed.Client(address, security=security)
    try:
        yield client
    finally:
        client.close()
