#!/usr/bin/env python
"""The accumulate step against a forward-backward call, in Numba and C.

For each mode (``NUMBA``: PyTensor 3's default, ``CVM``: C with BLAS; each
compiled through ``lasagne_accum.mode``) and dtype, on ``common.mlp``
(784-512-10, batch 64):

* ``acc``: ``pytensor.function([x, y], loss, updates=acc.accumulate)`` with
  ``acc = lasagne_accum.accumulate_gradients(loss, params)``;
* ``fb``: ``pytensor.function([x, y], [loss] + grads)`` (the loss and the
  gradients as outputs: the same forward and backward work);
* ``grads``: ``pytensor.function([x, y], grads)`` (gradients only).

Each (mode, dtype) runs in its own process (``common.Worker``), asked in
interleaved rounds so that the load of other processes hits them alike; within
a round its calls alternate one by one (acc, fb, grads, acc, ...). The table
shows medians per call and the median of the per-call ratios of neighbouring
calls (per round, then the median over rounds). Also shown: the in-place
``Gemm`` nodes writing into the accumulators, and tracemalloc's peak during one
accumulate call (numpy and Numba register their allocations) beside W1's size.

One process per configuration, because sharing one process skews the ratio
against ``acc``: the other configurations' calls between two accumulate calls
evict the accumulator from the cache (an accumulate must read it; ``fb``
writes a fresh output), and after a C call the system OpenBLAS's threads keep
spinning beside the next Numba call's (scipy's OpenBLAS): both move the ratio
by several per cent.

    python benchmarks/inplace.py            # about 2 minutes once compiled
    python benchmarks/inplace.py --quick
    OPENBLAS_NUM_THREADS=1 python benchmarks/inplace.py   # one BLAS thread
"""

import argparse
import os
import sys
import time
import tracemalloc

import pytensor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import (  # noqa: E402
    Worker, batch, interleaved_rounds, load_average, median, mlp, serve, worker_io,
)

import lasagne_accum as la  # noqa: E402

MODES = ("NUMBA", "CVM")
DTYPES = ("float32", "float64")


def build(mode, dtype):
    mode = la.mode(mode)
    (x, y), params, loss = mlp(dtype)
    acc = la.accumulate_gradients(loss, params)
    grads = pytensor.grad(loss, params)
    fns = {"acc": pytensor.function([x, y], loss, updates=acc.accumulate, mode=mode),
           "fb": pytensor.function([x, y], [loss, *grads], mode=mode),
           "grads": pytensor.function([x, y], grads, mode=mode)}
    fg = fns["acc"].maker.fgraph
    names = {fg.inputs[k]: i.variable.name for k, i in enumerate(fns["acc"].maker.inputs)}
    inplace = sorted(f"{node.op} on {names[node.inputs[j]]}" for node in fg.toposort()
                     for d in getattr(node.op, "destroy_map", {}).values() for j in d
                     if names.get(node.inputs[j], "").endswith("grad_accu"))
    return fns, inplace, params[0].get_value(borrow=True).nbytes


def peak_of_call(fn, data):
    fn(*data)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        fn(*data)
        return tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()


NAMES = ("acc", "fb", "grads")


def worker(args, proto):
    """One (mode, dtype): answer each round with medians of `args.calls` calls of each."""
    mode, dtype = args.worker.split("-")
    fns, inplace, w1 = build(mode, dtype)
    data = batch(dtype)
    for _ in range(3):  # warm-up (JIT compilation, first-call allocations)
        for f in fns.values():
            f(*data)
    meta = {"inplace": inplace, "w1": w1, "peak": peak_of_call(fns["acc"], data)}
    clock = time.perf_counter

    def measure(r):
        t = {n: [] for n in NAMES}
        for i in range(args.calls):
            for name in NAMES[i % 3:] + NAMES[:i % 3]:
                s = clock()
                fns[name](*data)
                t[name].append(clock() - s)
        out = {n: median(v) for n, v in t.items()}
        out["acc/fb"] = median(a / b for a, b in zip(t["acc"], t["fb"]))
        out["acc/grads"] = median(a / b for a, b in zip(t["acc"], t["grads"]))
        return out

    serve(proto, meta, measure)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--calls", type=int, default=None, help="calls of each function per round")
    p.add_argument("--threads", type=int, default=0, help=argparse.SUPPRESS)  # Worker's
    p.add_argument("--worker", choices=[f"{m}-{d}" for m in MODES for d in DTYPES],
                   help=argparse.SUPPRESS)
    args = p.parse_args()
    args.rounds = args.rounds or (2 if args.quick else 10)
    args.calls = args.calls or (20 if args.quick else 40)
    if args.worker:
        proto = worker_io()
        worker(args, proto)
        return
    print(load_average())
    here = os.path.abspath(__file__)
    workers = [Worker(here, f"{m}-{dt}", ["--calls", str(args.calls)], log=sys.stderr)
               for m in MODES for dt in DTYPES]
    try:
        meta = {w.name: w.ready() for w in workers}
        samples = interleaved_rounds(workers, args.rounds)
    finally:
        for w in workers:
            w.close()
    med = {k: median(v) for k, v in samples.items()}
    print(f"784-512-10 MLP, batch 64; one process per mode and dtype, {args.rounds} interleaved "
          f"rounds x {args.calls} calls of each, alternating; OPENBLAS_NUM_THREADS="
          f"{os.environ.get('OPENBLAS_NUM_THREADS', 'default')}")
    hdr = (f"{'mode':6} {'dtype':8} {'acc ms':>7} {'fb ms':>7} {'grads ms':>8} {'acc/fb':>7} "
           f"{'acc/grads':>9} {'peak MB':>8} {'W1 MB':>6}  in place on the accumulators")
    print(hdr)
    print("-" * len(hdr))
    summary = []
    for w in workers:
        m, dt = w.name.split("-")
        k = lambda n: med[f"{w.name}/{n}"]  # noqa: E731
        inplace, w1, peak = meta[w.name]["inplace"], meta[w.name]["w1"], meta[w.name]["peak"]
        print(f"{m:6} {dt:8} {k('acc') * 1e3:7.3f} {k('fb') * 1e3:7.3f} "
              f"{k('grads') * 1e3:8.3f} {k('acc/fb'):7.3f} {k('acc/grads'):9.3f} "
              f"{peak / 2**20:8.2f} {w1 / 2**20:6.2f}  {', '.join(inplace) or 'NONE'}")
        summary.append(((m, dt), k("acc/fb"), peak < w1 and len(inplace) >= 2))
    print("(acc/fb, acc/grads: median over rounds of the median ratio of neighbouring calls)")
    print()
    print("SUMMARY (target: measured -> verdict)")
    for (m, dt), r, no_alloc in summary:
        print(f"  {'PASS' if r <= 1.0 else 'MISS'}  1 accumulate / fwd-bwd <= 1.0 [{m} {dt}]: "
              f"{r:.3f}")
        print(f"  {'PASS' if no_alloc else 'MISS'}  1 no parameter-sized allocation, Gemm in "
              f"place [{m} {dt}]")
    print(load_average())


if __name__ == "__main__":
    main()
