#!/usr/bin/env python
"""What the exact large batch costs under batch normalisation, against ghost batches.

A 784-512-10 ReLU MLP with one batch-norm layer after the first dense layer, and the
same with a second hidden layer of 512 and a second batch-norm layer (float32, batch
64, Adam, windows of K = 4), compiled by ``lasagne_accum.compile_accumulation`` in the
library's default modes, once with ``batch_norm="ghost"`` (each micro-batch normalised
with its own statistics: one forward and backward per micro-batch) and once with
``batch_norm="exact"`` (the window's statistics: ``2 L + 1`` passes over the held
micro-batches for L layers). A window is K calls of ``trainer.step``.

Each model runs in its own process (``common.Worker``), asked in interleaved rounds;
within a round the two trainers' windows alternate one by one. The table shows the
median window time of each and the median of the per-window ratios of neighbouring
windows. No target: the passes are what exactness costs; the guide says so.

    python benchmarks/batch_norm.py            # about a minute once compiled
    python benchmarks/batch_norm.py --quick
"""

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import (  # noqa: E402
    batch, load_average, median, run_workers, serve, step_windows,
    worker_io,
)

import lasagne_accum as la  # noqa: E402

LAYERS = ("1", "2")
EVERY = 4


def build(layers, kind):
    import pytensor
    import pytensor.tensor as pt

    rng = np.random.RandomState(0)
    sizes = [784] + [512] * int(layers) + [10]
    shared = lambda v, n: pytensor.shared(v.astype("float32"), name=n)  # noqa: E731
    x, y = pt.matrix("x", dtype="float32"), pt.vector("y", dtype="int64")
    h, params = x, []
    for i, (n_in, n_out) in enumerate(zip(sizes[:-1], sizes[1:])):
        W = shared(rng.randn(n_in, n_out) * 0.05, f"W{i}")
        params.append(W)
        h = h @ W
        if i < len(sizes) - 2:
            g, b = shared(np.ones(n_out), f"g{i}"), shared(np.zeros(n_out), f"b{i}")
            rm, rv = shared(np.zeros(n_out), f"rm{i}"), shared(np.ones(n_out), f"rv{i}")
            params += [g, b]
            h = pt.maximum(la.batch_norm(h, g, b, rm, rv), 0)
    logp = h - pt.logsumexp(h, axis=1, keepdims=True)
    loss = -logp[pt.arange(y.shape[0]), y].mean()
    return la.compile_accumulation([x, y], loss, params, la.adam, dict(learning_rate=1e-3),
                                   every=EVERY, weight=x.shape[0], batch_norm=kind)


def worker(args, proto):
    trainers = {kind: build(args.worker, kind) for kind in ("exact", "ghost")}
    measure = step_windows(trainers, batch("float32"), EVERY, args.windows)
    serve(proto, {}, measure)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--windows", type=int, default=None, help="windows of each per round")
    p.add_argument("--threads", type=int, default=0, help=argparse.SUPPRESS)  # Worker's
    p.add_argument("--worker", choices=LAYERS, help=argparse.SUPPRESS)
    args = p.parse_args()
    args.rounds = args.rounds or (2 if args.quick else 10)
    args.windows = args.windows or (5 if args.quick else 20)
    if args.worker:
        worker(args, worker_io())
        return
    print(load_average())
    here = os.path.abspath(__file__)
    _, samples = run_workers([dict(script=here, name=n, args=["--windows", str(args.windows)])
                              for n in LAYERS], args.rounds, log=sys.stderr)
    med = {k: median(v) for k, v in samples.items()}
    print(f"784-512(-512)-10 MLP with a batch-norm layer after each hidden dense layer, "
          f"batch 64, float32, adam, windows of {EVERY}, default modes; one process per "
          f"model, {args.rounds} interleaved rounds x {args.windows} windows of each")
    hdr = f"{'bn layers':9} {'passes':>6} {'ghost ms':>9} {'exact ms':>9} {'exact/ghost':>12}"
    print(hdr)
    print("-" * len(hdr))
    for n in LAYERS:
        print(f"{n:9} {2 * int(n) + 1:>6} {med[f'{n}/ghost'] * 1e3:9.3f} "
              f"{med[f'{n}/exact'] * 1e3:9.3f} {med[f'{n}/ratio']:12.3f}")
    print("(ms: median window; exact/ghost: median over rounds of the median ratio of "
          "neighbouring windows; passes: over the window's micro-batches in exact mode)")
    print(load_average())


if __name__ == "__main__":
    main()
