#!/usr/bin/env python
"""Parameter-server throughput and time to a target loss on the digits MLP.

Three tables (Markdown), with the load average before and after:

0. where a Dask push's time goes (async, 1 worker, the digits MLP): the median
   push round trip by the backend's two transports (``transport="direct"``,
   the default, and ``"dask"``), the compiled apply step, a no-op request to
   the shards of the task's own process (no message) and to those of the
   other process four ways (a Dask actor call, the shard handler through the
   worker's rpc pool and event loop, the handler over the calling thread's
   persisted Dask comm: ``transport="dask"``, and the thread's direct link:
   ``"direct"``), and the push's arrays through Dask's serialization and
   through one pickle, there and back.

1. sync vs async, 1 vs 2 workers, local (threads) vs dask (a loopback
   LocalCluster of 2 processes): pushes per second during training (compiling
   excluded), optimizer steps, and the seconds until the full training-set
   loss first drops below ``--target`` (from snapshots of the server's
   parameters taken every ``--snapshot`` seconds while training runs, scored
   afterwards).
2. local accumulation: gradient bytes pushed per training example, and the
   pushes, for N = 1, 4, 16 batches accumulated per push.

    python benchmarks/distributed.py            # < 5 minutes
    python benchmarks/distributed.py --quick    # < 90 seconds

The model is ``examples/distributed_digits.py``'s 64-64-10 ReLU MLP, float32,
batch 32, Adam; PyTensor's default compile modes. Times are wall clock on a
shared machine: compare within a run.
"""

import argparse
import os
import sys
import time

import numpy as np
import pytensor

HERE = os.path.dirname(os.path.abspath(__file__))
# this file is called distributed.py: keep `import distributed` meaning Dask's package
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != HERE]
sys.path.insert(0, os.path.join(HERE, "..", "examples"))

from distributed_digits import build_model, mlp, worker_batches  # noqa: E402
from models import load_data_or_exit  # noqa: E402

from lasagne_accum import adam  # noqa: E402
from lasagne_accum.distributed import train  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer epochs (< 90 s)")
    p.add_argument("--epochs", type=int, default=None, help="default 10 (quick: 5)")
    p.add_argument("--target", type=float, default=None,
                   help="target training loss (default 0.3; quick: 0.4)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--snapshot", type=float, nargs=2, default=(0.02, 0.02),
                   metavar=("LOCAL", "DASK"),
                   help="seconds between snapshots (each a pull), local and dask (default 0.02 "
                        "0.02)")
    p.add_argument("--repeat", type=int, default=None,
                   help="runs per local configuration, median reported (default 3; quick: "
                        "1); dask runs one fewer")
    p.add_argument("--no-dask", action="store_true", help="local backend only")
    args = p.parse_args(argv)
    args.epochs = args.epochs or (5 if args.quick else 10)
    args.target = args.target or (0.4 if args.quick else 0.3)
    args.repeat = args.repeat or (1 if args.quick else 3)
    return args


def scorer(X, y):
    """``loss(params)`` on the whole training set, with a model of our own."""
    (x, yv), params, loss, _ = mlp()
    fn = pytensor.function([x, yv], loss)

    def score(values):
        for p in params:
            p.set_value(values[p.name])
        return float(fn(X, y))

    return score


def time_to_target(result, score, target):
    t0 = result.t_start
    for t, _, params in result.history:
        if t >= t0 and score(params) <= target:
            return t - t0
    return float("nan")


def _probe(server, via_comm, grads, n):
    """Inside a Dask task: medians (s) of the ways to reach the shards, and of a push.

    `server` uses direct links, `via_comm` (the same placement) Dask comms.
    A no-op request (``next_seq`` of one shard) to the shards of this process
    (a direct call), and to those of the other process four ways: through
    the Dask actor (the transport before both), through the shard handler
    with the worker's own rpc pool and event loop (a thread hop each way),
    over this thread's persisted Dask comm (``transport="dask"``) and over
    its direct link (``"direct"``); the push's arrays through Dask's
    per-array serialization and through one pickle, there and back; and the
    push itself by both transports.
    """
    import pickle

    import distributed
    from distributed.protocol import deserialize_bytes, serialize_bytelist

    from lasagne_accum.distributed.dask import HANDLER, ShardActor

    wid = "probe"
    version, _ = server.register(wid)
    version_comm, _ = via_comm.register(wid)
    worker = distributed.get_worker()
    here = [i for i, g in enumerate(server._group_of) if server._here(g) is not None]
    there = [i for i, g in enumerate(server._group_of) if server._here(g) is None]
    g = server._group_of[there[0]]
    name = server.shard_names[there[0]]
    job = ("call", ("next_seq", [(name, (wid,))]))
    payload = pickle.dumps(job, protocol=5)
    rpc = worker.rpc(server.hosts[g])
    actor = distributed.Actor(ShardActor, server.hosts[g], server._keys[g])   # a handle here

    def via_rpc():
        return distributed.utils.sync(worker.loop, lambda: getattr(rpc, HANDLER)(
            key=server._keys[g], payload=payload))

    def dask_ser():
        for a in grads.values():
            deserialize_bytes(b"".join(serialize_bytelist(a)))

    ways = dict(
        here=lambda: server._call(here[:1], "next_seq", [(wid,)]),
        actor=lambda: actor.call("next_seq", [(name, (wid,))]).result(),
        rpc=via_rpc,
        comm=lambda: via_comm._remote({g: job}, "probe")[g],
        direct=lambda: server._remote({g: job}, "probe")[g],
        dask_ser=dask_ser,
        pickle=lambda: pickle.loads(pickle.dumps(grads, protocol=5)),
    )
    times = {k: [] for k in list(ways) + ["push", "push_comm"]}
    for i in range(n):
        for k, fn in ways.items():
            t = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t)
        t = time.perf_counter()
        version = server.push(wid, i, grads, version=version, pull=True)["version"]
        times["push"].append(time.perf_counter() - t)
        t = time.perf_counter()
        version_comm = via_comm.push(wid, i, grads, version=version_comm, pull=True)["version"]
        times["push_comm"].append(time.perf_counter() - t)
    server.unregister(wid)
    via_comm.unregister(wid)
    return {k: float(np.median(v)) for k, v in times.items()}


def apply_time(n=200):
    """Median seconds of one shard's compiled Adam step on the digits MLP, in this process."""
    from lasagne_accum.distributed.server import ParameterServer

    params = {p.name: p.get_value() for p in mlp()[1]}
    server = ParameterServer(params, adam, dict(learning_rate=1e-3), mode="async")
    zero = {n_: np.zeros_like(v) for n_, v in params.items()}
    times = {s.name: [] for s in server.shards}
    for shard in server.shards:
        arrays = [zero[n_] for n_ in shard.params]
        for _ in range(n):
            t = time.perf_counter()
            shard.fn(arrays, 1e-3)
            times[shard.name].append(time.perf_counter() - t)
    return sum(float(np.median(v)) for v in times.values()), zero, params


def breakdown(client, n=200):
    """Table 0's numbers: {what: median s}, with the apply step."""
    from lasagne_accum.distributed.dask import DaskParameterServer

    apply_s, zero, params = apply_time(n)
    server = DaskParameterServer(client, params, adam, dict(learning_rate=1e-3), mode="async")
    via_comm = DaskParameterServer(client, params, adam, dict(learning_rate=1e-3),
                                   mode="async", transport="dask")
    try:
        assert server.placement == via_comm.placement and server.transport == "direct"
        parts = client.submit(_probe, server, via_comm, zero, n, pure=False).result()
    finally:
        server.close()
        via_comm.close()
    return dict(parts, apply=apply_s)


def run(args, X, y, score, backend, mode, workers, client=None, accumulate=1, epochs=None,
        snapshot=None):
    data = worker_batches(X, y, workers, args.batch_size, epochs or args.epochs, seed=0)
    r = train(build_model, data, adam, dict(learning_rate=args.lr), mode=mode, backend=backend,
              accumulate=accumulate, client=client, snapshot_interval=snapshot)
    return r


def main(argv=None):
    args = parse_args(argv)
    start = time.perf_counter()
    (X, y, _, _), _ = load_data_or_exit(0)
    score = scorer(X, y)
    rows = []

    def measure(backend, client=None):
        repeat = args.repeat if backend == "local" else max(1, args.repeat - 1)
        snapshot = args.snapshot[backend == "dask"]
        for mode in ("sync", "async"):
            for workers in (1, 2):
                runs = [run(args, X, y, score, backend, mode, workers, client=client,
                            snapshot=snapshot) for _ in range(repeat)]
                runs.sort(key=lambda r: r.pushes_per_second)
                r = runs[len(runs) // 2]                      # the median run
                med = float(np.median([t for w in r.workers for t in w["push_s"]]))
                rows.append((backend, mode, workers, r.pushes_per_second, r.version[0],
                             time_to_target(r, score, args.target), r.elapsed,
                             score(r.params), med))
                print(f"  {backend} {mode} {workers}: {r.pushes_per_second:.0f} pushes/s",
                      file=sys.stderr, flush=True)

    load_before = os.getloadavg()
    parts = None
    measure("local")
    if not args.no_dask:
        from lasagne_accum.distributed.dask import local_cluster

        with local_cluster(2) as client:
            parts = breakdown(client)
            measure("dask", client)

    comm = []
    for n in (1, 4, 16):
        r = run(args, X, y, score, "local", "async", 1, accumulate=n,
                epochs=max(1, args.epochs // 2))
        comm.append((n, r.bytes_per_example, r.pushes, r.examples, score(r.params)))

    load_after = os.getloadavg()
    print(f"\nLoad average (1, 5, 15 min) before: {', '.join(f'{v:.2f}' for v in load_before)}; "
          f"after: {', '.join(f'{v:.2f}' for v in load_after)} ({os.cpu_count()} CPUs)")
    if parts is not None:
        print("\nWhere a Dask push goes (async, 1 worker, from a task in a process holding "
              "half the shards; medians of 200, ms):\n")
        print("| what | ms |")
        print("|---|---|")
        for key, what in (
                ("push", "push round trip (pull=True, both processes), direct links"),
                ("push_comm", "push round trip (pull=True, both processes), Dask comms"),
                ("apply", "apply step (all shards, compiled)"),
                ("here", "no-op request, shards of this process (direct call)"),
                ("actor", "no-op request, other process: Dask actor call (before)"),
                ("rpc", "no-op request, other process: handler via the worker's rpc and loop"),
                ("comm", "no-op request, other process: handler over this thread's Dask comm"),
                ("direct", "no-op request, other process: this thread's direct link (now)"),
                ("dask_ser", "the push's arrays through Dask's serialize, there and back"),
                ("pickle", "the push's arrays pickled (protocol 5), there and back")):
            print(f"| {what} | {parts[key] * 1e3:.3f} |")
        print(f"| push - apply, direct links | {(parts['push'] - parts['apply']) * 1e3:.3f} |")
    print(f"\nDigits MLP 64-64-10 (float32), batch {args.batch_size}, Adam lr {args.lr}, "
          f"{args.epochs} epochs split over the workers; target training loss {args.target}.\n")
    print("| backend | mode | workers | pushes/s | vs 1 worker | median push ms | optimizer "
          "steps | s to target loss | training s | final train loss |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    one = {(b, m): pps for b, m, w, pps, *_ in rows if w == 1}
    for backend, mode, workers, pps, steps, ttt, elapsed, final, med in rows:
        ttt = f"{ttt:.2f}" if np.isfinite(ttt) else "not reached"
        print(f"| {backend} | {mode} | {workers} | {pps:.0f} | {pps / one[backend, mode]:.2f}x | "
              f"{med * 1e3:.2f} | {steps} | {ttt} | {elapsed:.2f} | {final:.3f} |")
    print(f"\nLocal accumulation (1 worker, async, {max(1, args.epochs // 2)} epochs):\n")
    print("| N batches per push | bytes pushed per example | pushes | examples | "
          "final train loss |")
    print("|---|---|---|---|---|")
    for n, bpe, pushes, examples, final in comm:
        print(f"| {n} | {bpe:.1f} | {pushes} | {examples:.0f} | {final:.3f} |")
    print(f"\n(total {time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
