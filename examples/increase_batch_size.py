#!/usr/bin/env python
"""Increase the batch size instead of decaying the learning rate (Smith et al. 2017).

Smith, Kindermans, Ying and Le, "Don't Decay the Learning Rate, Increase the Batch Size"
(arXiv 1711.00489): dividing the learning rate by alpha at fixed epochs and multiplying
the batch size by alpha at the same epochs instead reach the same test accuracy, the
second with fewer parameter updates.

Two runs of ``--epochs`` epochs on scikit-learn's digits, per seed, from the same initial
MLP and the same examples in the same order, momentum SGD, micro-batches of
``--batch-size``:

* ``decay lr``: K = 1; the learning rate divided by ``--alpha`` at 1/3 and 2/3 of the
  epochs (``schedules.piecewise_constant`` keyed in examples);
* ``increase batch``: the learning rate constant; K multiplied by ``--alpha`` at the same
  points (``compile_accumulation(every=callable)`` of the examples seen; one compiled
  function for every K).

Prints, per run, the test accuracy (mean and standard deviation over the seeds) and the
parameter updates; writes the table and a plot of test accuracy against epochs and
against updates to ``--out``.

    python examples/increase_batch_size.py            # about a minute
    python examples/increase_batch_size.py --quick    # seconds
"""

import time

import numpy as np
import pytensor

import lasagne_accum
from lasagne_accum import compile_accumulation, schedules

import models


def parse_args(argv=None):
    p = models.parser(__doc__)
    p.add_argument("--epochs", type=models.positive_int, default=30)
    p.add_argument("--seeds", type=models.positive_int, default=5)
    p.add_argument("--batch-size", type=models.positive_int, default=16,
                   help="examples per micro-batch (the batch before any increase)")
    p.add_argument("--alpha", type=models.positive_int, default=5,
                   help="the factor of each learning-rate decay, or batch-size increase")
    p.add_argument("--hidden", type=models.positive_int, default=64)
    p.add_argument("--quick", action="store_true", help="6 epochs, 2 seeds (seconds)")
    models.add_flags(p, lr=0.05, mode=None, out="out", no_progress=False)
    return p.parse_args(argv)


def run(kind, seed, data, args):
    """One run; its test accuracy after each epoch and its updates."""
    X, y, X_test, y_test = data
    n, alpha = len(X), args.alpha
    # the two change points, in examples: after 1/3 and 2/3 of the epochs
    points = [n * args.epochs // 3, n * 2 * args.epochs // 3]
    model = models.build_mlp(X.shape[1], args.hidden, 10, seed)
    if kind == "decay lr":
        lr = schedules.piecewise_constant(args.lr, {p: 1 / alpha for p in points},
                                          unit="examples")
        every = 1
    else:
        lr = args.lr

        def every(examples):
            return alpha ** sum(examples >= p for p in points)

    trainer = compile_accumulation([model.x, model.y], model.loss, model.params,
                                   lasagne_accum.momentum, dict(learning_rate=lr, momentum=0.9),
                                   every=every, weight=model.x.shape[0], mode=args.mode)
    evaluate = pytensor.function([model.x, model.y], model.accuracy,
                                 mode=lasagne_accum.mode(args.mode or "CVM"))
    rng = np.random.default_rng(seed)
    curve = []
    for _ in range(args.epochs):
        for batch in models.minibatches(X, y, args.batch_size, rng):
            trainer.step(*batch)
        curve.append((trainer.steps, float(evaluate(X_test, y_test))))
    trainer.flush()
    return {"accuracy": float(evaluate(X_test, y_test)), "updates": trainer.steps,
            "curve": curve}


def main(argv=None):
    args = parse_args(argv)
    if args.quick:
        args.epochs, args.seeds = min(args.epochs, 6), min(args.seeds, 2)
    start = time.perf_counter()
    kinds = ("decay lr", "increase batch")
    results = {kind: [] for kind in kinds}
    bar = models.progress(range(args.seeds), desc="seeds", enabled=not args.no_progress)
    for seed in bar:
        (X, y, X_test, y_test), _ = models.load_data_or_exit(seed)
        for kind in kinds:
            results[kind].append(run(kind, seed, (X, y, X_test, y_test), args))
    lines = [f"digits MLP 64-{args.hidden}-10, {args.epochs} epochs, micro-batches of "
             f"{args.batch_size}, momentum SGD lr={args.lr}, alpha={args.alpha} at 1/3 and 2/3 "
             f"of the epochs, {args.seeds} seeds",
             f"{'run':<16} {'test accuracy %':>16} {'std':>6} {'updates':>8}"]
    for kind in kinds:
        acc = 100 * np.array([r["accuracy"] for r in results[kind]])
        updates = results[kind][0]["updates"]
        lines.append(f"{kind:<16} {acc.mean():16.2f} {acc.std():6.2f} {updates:8d}")
    table = "\n".join(lines)
    def draw(plt):
        fig = plt.gcf()
        left, right = fig.subplots(1, 2, sharey=True)
        for kind in kinds:
            acc = np.mean([[a for _, a in r["curve"]] for r in results[kind]], axis=0)
            updates = [u for u, _ in results[kind][0]["curve"]]
            left.plot(range(1, args.epochs + 1), 100 * acc, label=kind)
            right.plot(updates, 100 * acc, label=kind)
        left.set(xlabel="epoch", ylabel="test accuracy % (mean over seeds)")
        right.set(xlabel="parameter updates")
        right.legend()

    models.report(args.out, "increase_batch_size", table, draw, start)
    return results


if __name__ == "__main__":
    main()
