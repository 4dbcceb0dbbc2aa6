#!/usr/bin/env python
"""What measuring the gradient noise scale costs a window, in C and Numba.

On ``common.mlp`` (784-512-10, float32, Adam), for each mode (``CVM`` and
``NUMBA``, through ``lasagne_accum.mode``) and micro-batch size (64, the
target's, and 256, where the squares no longer come from the Gram matrices):
two trainers of ``lasagne_accum.compile_accumulation(..., every=4,
weight=x.shape[0])``, one with ``noise_scale=True`` (one squared-norm reduction
per micro-batch, the estimates from each apply) and one without. A window is 4
accumulate calls and one apply call (``trainer.step`` four times).

Each mode runs in its own process (``common.Worker``), asked in interleaved
rounds; within a round the two trainers' windows alternate one by one. The
table shows the median window time of each and the median of the per-window
ratios of neighbouring windows (per round, then the median over rounds).

    python benchmarks/noise.py            # about two minutes once compiled
    python benchmarks/noise.py --quick
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import (  # noqa: E402
    batch, load_average, median, mlp, run_workers, serve, step_windows,
    worker_io,
)

import lasagne_accum as la  # noqa: E402

MODES = ("CVM", "NUMBA")
EVERY = 4
TARGET = 1.05
BATCHES = (64, 256)   # the first is the target's


def build(mode, noise):
    (x, y), params, loss = mlp("float32")
    return la.compile_accumulation([x, y], loss, params, la.adam, dict(learning_rate=1e-3),
                                   every=EVERY, weight=x.shape[0], noise_scale=noise,
                                   mode=mode)


def _key(size, name):
    return name if size == BATCHES[0] else f"b{size}/{name}"


def worker(args, proto):
    measures = {size: step_windows({"noise": build(args.worker, True),
                                    "plain": build(args.worker, False)},
                                   batch("float32", size=size), EVERY, args.windows)
                for size in BATCHES}

    def measure(r):
        return {_key(size, k): v for size, m in measures.items() for k, v in m(r).items()}

    serve(proto, {}, measure)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--windows", type=int, default=None, help="windows of each per round")
    p.add_argument("--threads", type=int, default=0, help=argparse.SUPPRESS)  # Worker's
    p.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)
    args = p.parse_args()
    args.rounds = args.rounds or (2 if args.quick else 10)
    args.windows = args.windows or (10 if args.quick else 40)
    if args.worker:
        worker(args, worker_io())
        return
    print(load_average())
    here = os.path.abspath(__file__)
    _, samples = run_workers([dict(script=here, name=n, args=["--windows", str(args.windows)])
                              for n in MODES], args.rounds, log=sys.stderr)
    med = {k: median(v) for k, v in samples.items()}
    print(f"784-512-10 MLP, float32, adam, windows of {EVERY}; one process per mode, "
          f"{args.rounds} interleaved rounds x {args.windows} windows of each, alternating")
    hdr = f"{'mode':6} {'batch':>5} {'plain ms':>9} {'noise ms':>9} {'noise/plain':>12}"
    print(hdr)
    print("-" * len(hdr))
    for m in MODES:
        for size in BATCHES:
            key = f"{m}/{_key(size, '')}"
            print(f"{m:6} {size:5d} {med[key + 'plain'] * 1e3:9.3f} "
                  f"{med[key + 'noise'] * 1e3:9.3f} {med[key + 'ratio']:12.3f}")
    print("(ms: median window; noise/plain: median over rounds of the median ratio of "
          "neighbouring windows)")
    print()
    print("SUMMARY (target: measured -> verdict)")
    for m in MODES:
        r = med[f"{m}/ratio"]
        print(f"  {'PASS' if r <= TARGET else 'MISS'}  5 window with noise_scale / without "
              f"<= {TARGET} [{m}]: {r:.3f}")
    print(load_average())


if __name__ == "__main__":
    main()
