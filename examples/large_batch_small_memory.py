#!/usr/bin/env python
"""A batch of N*B examples in the memory of B: accumulation vs the real large batch.

For each N, two copies of the same model start from the same parameters and
train for ``--steps`` optimizer steps on the same effective batches of N*B
examples:

* accumulation: the two-function form (:func:`lasagne_accum.accumulate_gradients`),
  N calls of the accumulate function on mini-batches of B examples, then one
  call of the apply function (only B examples are in memory at a time);
* real batch: the plain rule, one call on all N*B examples at once.

The model's loss is a mean over examples and has no batch statistics, so both
compute the same gradient: the script prints the largest difference between
their final parameters (float64 by default: of the order of 1e-16, and
checked against 1e-10), and the peak memory of one optimizer step for each N,
as a table and as a plot (``OUT/large_batch_small_memory.png``).

Peak memory is measured in-process with :mod:`tracemalloc` (numpy and
Numba's runtime report their array allocations to it; the C backend
allocates through numpy): the peak of traced memory during one optimizer
step, inputs included (the real batch holds N*B examples at once,
accumulation one mini-batch of B), minus what was traced before the step.
Memory that stays allocated between steps (parameters, the rule's state,
accumulation buffers) is not part of this peak. It is measured on every step
but the first (which allocates once-only buffers) and the largest is shown.
With ``--mode JAX`` the arrays live in XLA's memory, which tracemalloc does
not see: the peak is then XLA's own analysis of the compiled functions
(:func:`lasagne_accum.step_memory`, what a call needs beyond the resident
state); with ``--mode PYTORCH`` it is not measured (``n/a``; see
``benchmarks/gpu.py``).

    python examples/large_batch_small_memory.py --batch-size 64 --n 1,2,4,8,16
"""

import argparse
import os
import time
import tracemalloc

import numpy as np
import pytensor

from lasagne_accum import accumulate_gradients, collect_state, mode, step_memory

import models

MiB = 2.0 ** 20


def n_list(text):
    """argparse type: comma-separated integers >= 1."""
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"every N must be >= 1, got {text}")
    return values


def parse_args(argv=None):
    p = models.parser(__doc__)
    p.add_argument("--n", type=n_list, default=[1, 2, 4, 8, 16], metavar="N1,N2,...",
                   help="accumulation counts N to compare (default: 1,2,4,8,16)")
    p.add_argument("--batch-size", type=models.positive_int, default=64, metavar="B",
                   help="mini-batch size B")
    p.add_argument("--steps", type=models.positive_int, default=3,
                   help="optimizer steps per N")
    models.add_flags(p, optimizer="adam", lr=1e-3, model="cnn",
                     dtype=("float64", "float64 for the exactness check"), mode=None,
                     seed=(0, "seed of the initial parameters and the data order"), out="out",
                     no_plot=(False, "do not draw the memory plot"), no_progress=False)
    return p.parse_args(argv)


def peak_bytes(run):
    """Peak traced memory during ``run()`` above what was traced when it started."""
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        run()
        return tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()


class Comparison:
    """Two copies of the model, compiled once: N is only a loop count.

    The accumulation side is the two-function recipe of the README written
    out: :func:`accumulate_gradients`, the rule on its ``.grads``, the reset
    merged into the apply function. Calling the accumulate function N times
    before each apply makes the effective batch N*B, so one compilation
    serves every N. Before each N, every shared variable the functions
    update (:func:`lasagne_accum.collect_state`) goes back to its initial
    value.
    """

    def __init__(self, args):
        rule, hyper = models.rule(args.optimizer), {"learning_rate": args.lr}
        acc_mode, apply_mode = (mode(m) for m in models.mode_names(args.mode))
        small = models.build_model(args.model, args.side, seed=args.seed, dtype=args.dtype)
        big = models.build_model(args.model, args.side, seed=args.seed, dtype=args.dtype)
        self.small_params, self.big_params = small.params, big.params

        accu, reset = accumulate_gradients(small.loss, small.params, weight=small.x.shape[0])
        apply = rule(accu.grads, small.params, **hyper)
        apply.update(reset)
        self.step_fn = pytensor.function([small.x, small.y], small.loss, updates=accu,
                                         mode=acc_mode)
        self.apply_fn = pytensor.function([], [], updates=apply, mode=apply_mode)

        big_updates = rule(big.loss, big.params, **hyper)
        self.big_fn = pytensor.function([big.x, big.y], big.loss, updates=big_updates,
                                        mode=acc_mode)
        self.initial = {var: var.get_value(borrow=False)
                        for var in collect_state(accu, apply, big_updates).values()}

    def run(self, n, X, y, args):
        """Train both ways for one N; the parameter difference and the peaks."""
        for var, value in self.initial.items():
            var.set_value(value.copy())
        B = args.batch_size
        order = np.random.RandomState(args.seed).permutation(len(X))
        peaks = {"accumulation": 0, "real batch": 0}
        bar = models.progress(range(args.steps), desc=f"N={n}", enabled=not args.no_progress)
        for step in bar:
            # the step-th effective batch of N*B examples (wrapping around the data)
            index = order[(step * n * B + np.arange(n * B)) % len(X)]

            def accumulate():
                for k in range(n):      # one mini-batch of B examples in memory at a time
                    part = index[k * B:(k + 1) * B]
                    self.step_fn(X[part], y[part])
                self.apply_fn()

            def real_batch():
                self.big_fn(X[index], y[index])   # all N*B examples at once

            for name, run in (("accumulation", accumulate), ("real batch", real_batch)):
                if step == 0 and args.steps > 1:
                    run()                     # first call: once-only allocations
                else:
                    peaks[name] = max(peaks[name], peak_bytes(run))
        diff = max(float(np.max(np.abs(models.value(a) - models.value(b))))
                   for a, b in zip(self.small_params, self.big_params))
        if args.mode == "JAX":     # XLA's memory, which tracemalloc does not see
            x1, y1 = X[:B], y[:B]
            xn, yn = X[np.arange(n * B) % len(X)], y[np.arange(n * B) % len(y)]
            peaks = {"accumulation": max(step_memory(self.step_fn, x1, y1).transient,
                                         step_memory(self.apply_fn).transient),
                     "real batch": step_memory(self.big_fn, xn, yn).transient}
        elif args.mode == "PYTORCH":   # torch's allocations: not traced either
            peaks = {"accumulation": float("nan"), "real batch": float("nan")}
        return dict(n=n, effective=n * B, diff=diff, accum_mib=peaks["accumulation"] / MiB,
                    real_mib=peaks["real batch"] / MiB)


def plot(rows, args, path):
    def draw(plt):
        ns = [r["n"] for r in rows]
        plt.plot(ns, [r["real_mib"] for r in rows], "o-", label="real batch of N*B")
        plt.plot(ns, [r["accum_mib"] for r in rows], "s-",
                 label=f"accumulation: N mini-batches of B={args.batch_size}")
        plt.xscale("log", base=2)
        plt.xticks(ns, [str(n) for n in ns])
        plt.xlabel("N (effective batch N*B)")
        plt.ylabel("peak memory of one step, MiB (tracemalloc)")
        plt.title(f"{args.model.upper()}, {args.dtype}, {args.optimizer}: "
                  "same parameters, less memory", fontsize=10)
        plt.legend()

    return models.save_plot(path, draw)


def main(argv=None):
    args = parse_args(argv)
    out = None if args.no_plot else models.out_dir(args.out)   # fail early, not after training
    (X, y, _, _), args.side = models.load_data_or_exit(args.seed, dtype=args.dtype)
    print(f"{args.model.upper()} on {args.side}x{args.side} digits, {args.dtype}, "
          f"{args.optimizer} lr={args.lr:g}; B={args.batch_size}, {args.steps} steps per N",
          flush=True)
    start = time.perf_counter()
    comparison = Comparison(args)
    rows = [comparison.run(n, X, y, args) for n in args.n]

    how = {"JAX": " (XLA's analysis)", "PYTORCH": " (not measured for PYTORCH)"}.get(
        args.mode, "")
    print(f"\n{'N':>4} {'N*B':>6} {'peak MiB accumulation':>22} {'peak MiB real batch':>20} "
          f"{'max |param diff|':>17}{how}")
    for r in rows:
        accum, real = (f"{v:{w}.2f}" if np.isfinite(v) else f"{'n/a':>{w}}"
                       for v, w in ((r["accum_mib"], 22), (r["real_mib"], 20)))
        print(f"{r['n']:4d} {r['effective']:6d} {accum} {real} "
              f"{r['diff']:17.3e}")
    worst = max(r["diff"] for r in rows)
    tolerance = 1e-10 if args.dtype == "float64" else 1e-4
    same = worst < tolerance
    print(f"max difference of the final parameters over all N: {worst:.3e} "
          f"({'<' if same else 'NOT <'} {tolerance:g}: "
          f"{'same parameters' if same else 'the parameters differ'})")
    png = None
    if not args.no_plot:
        png = plot(rows, args, os.path.join(out, "large_batch_small_memory.png"))
        if png:
            print(f"plot: {png}")
    print(f"done in {time.perf_counter() - start:.1f} s (compiling included)")
    return dict(rows=rows, max_diff=worst, same=same, plot=png)


if __name__ == "__main__":
    main()
