#!/usr/bin/env python
"""The accumulate step against a forward-backward call, in Numba and C (issue 13, item 1).

For each mode (``NUMBA``: PyTensor 3's default, ``CVM``: C with BLAS) and
dtype, on ``common.mlp`` (784-512-10, batch 64):

* ``acc``: ``pytensor.function([x, y], loss, updates=acc.accumulate)`` with
  ``acc = lasagne_accum.accumulate_gradients(loss, params)``;
* ``fb``: ``pytensor.function([x, y], [loss] + grads)`` (the loss and the
  gradients as outputs: the same forward and backward work);
* ``grads``: ``pytensor.function([x, y], grads)`` (gradients only).

Calls alternate one by one (acc, fb, grads, acc, ...), so that the load of
other processes hits them alike; the table shows medians per call and the
median of the per-call ratios of neighbouring calls. Also shown: the in-place
``Gemm`` nodes writing into the accumulators, and tracemalloc's peak during one
accumulate call (numpy and Numba register their allocations) beside W1's size.

    python benchmarks/inplace.py            # about 2 minutes once compiled
    python benchmarks/inplace.py --quick
    OPENBLAS_NUM_THREADS=1 python benchmarks/inplace.py   # one BLAS thread
"""

import argparse
import os
import sys
import time
import tracemalloc

import numpy as np
import pytensor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import batch, load_average, median, mlp  # noqa: E402

import lasagne_accum as la  # noqa: E402

MODES = ("NUMBA", "CVM")
DTYPES = ("float32", "float64")


def build(mode, dtype):
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


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--calls", type=int, default=None, help="calls of each function")
    args = p.parse_args()
    calls = args.calls or (40 if args.quick else 400)
    print(load_average())
    built = {(m, dt): build(m, dt) for m in MODES for dt in DTYPES}
    data = {dt: batch(dt) for dt in DTYPES}
    for (m, dt), (fns, _, _) in built.items():
        for f in fns.values():
            f(*data[dt])
    times = {k: {n: [] for n in ("acc", "fb", "grads")} for k in built}
    clock = time.perf_counter
    for i in range(calls):
        for k, (fns, _, _) in built.items():
            for name in ("acc", "fb", "grads")[i % 3:] + ("acc", "fb", "grads")[:i % 3]:
                s = clock()
                fns[name](*data[k[1]])
                times[k][name].append(clock() - s)
    print(f"784-512-10 MLP, batch 64; {calls} calls of each, alternating; OPENBLAS_NUM_THREADS="
          f"{os.environ.get('OPENBLAS_NUM_THREADS', 'default')}")
    hdr = (f"{'mode':6} {'dtype':8} {'acc ms':>7} {'fb ms':>7} {'grads ms':>8} {'acc/fb':>7} "
           f"{'acc/grads':>9} {'peak MB':>8} {'W1 MB':>6}  in place on the accumulators")
    print(hdr)
    print("-" * len(hdr))
    summary = []
    for k, (fns, inplace, w1) in built.items():
        t = times[k]
        r_fb = median(a / b for a, b in zip(t["acc"], t["fb"]))
        r_gr = median(a / b for a, b in zip(t["acc"], t["grads"]))
        peak = peak_of_call(fns["acc"], data[k[1]])
        print(f"{k[0]:6} {k[1]:8} {median(t['acc']) * 1e3:7.3f} {median(t['fb']) * 1e3:7.3f} "
              f"{median(t['grads']) * 1e3:8.3f} {r_fb:7.3f} {r_gr:9.3f} {peak / 2**20:8.2f} "
              f"{w1 / 2**20:6.2f}  {', '.join(inplace) or 'NONE'}")
        summary.append((k, r_fb, peak < w1 and len(inplace) >= 2))
    print("(acc/fb, acc/grads: median of the ratios of neighbouring calls)")
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
