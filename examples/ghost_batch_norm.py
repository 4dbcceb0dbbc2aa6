#!/usr/bin/env python
"""Ghost batch normalisation and the generalisation gap of large batches (Hoffer et al. 2017).

Hoffer, Hubara and Soudry, "Train longer, generalize better: closing the generalization
gap in large batch training of neural networks" (arXiv 1705.08741): a network trained
with a large batch reaches a lower test accuracy than with a small batch (the
*generalisation gap*). Their remedy: scale the learning rate by the square root of the
batch ratio (``lr_large = lr_small * sqrt(B_large / B_small)``), normalise with the
statistics of small *ghost batches* (e.g. 32 examples) inside the large batch, and
train for as many updates as the small batch ("regime adaptation").

The batch-norm CNN of ``batch_norm_digits.py`` (two :func:`lasagne_accum.batch_norm`
layers) on scikit-learn's bundled digits, momentum SGD, micro-batches of
``--batch-size`` (every micro-batch full; the learning rate divided by 10 after 2/3 of
each run's updates), four runs per seed from the same initial parameters and the same
examples in the same order:

* ``small``: K = 1, the small batch B_S = ``--batch-size``, learning rate ``--lr``;
* ``large exact``: K = ``--accumulate`` micro-batches per update (B_L = K * B_S),
  normalised with the whole window's statistics (``batch_norm="exact"``: the true large
  batch), learning rate ``schedules.sqrt_scaling(lr, B_S, B_L)``, the same epochs;
* ``large ghost``: the same, each micro-batch normalised with its own statistics
  (``batch_norm="ghost"``: ghost batches of B_S); nothing else differs;
* ``large ghost long``: ``large ghost`` trained K times the epochs, so as many updates
  as ``small`` (regime adaptation).

Every run moves the running statistics once per update with the update's pooled
statistics (``running_stats="pooled"``) and is evaluated with them
(``deterministic=True``). Two generalisation gaps are reported, in accuracy points,
mean and standard deviation over the seeds: *gap* = the small batch's test accuracy
minus the run's (per seed; the paper's gap), and *train - test* = the run's training
accuracy minus its test accuracy. Prints the table and writes it to
``OUT/ghost_batch_norm.txt``, with a plot of the test accuracy against epochs and
against updates (``OUT/ghost_batch_norm.png``).

    python examples/ghost_batch_norm.py            # about two minutes
    python examples/ghost_batch_norm.py --quick    # seconds
"""

import time
from dataclasses import dataclass

import numpy as np
import pytensor

import lasagne_accum
from lasagne_accum import compile_accumulation, schedules

import batch_norm_digits
import models


@dataclass(frozen=True)
class Run:
    """One row: its micro-batches per update, batch-norm mode and epoch multiplier."""

    name: str
    large: bool          # K = --accumulate (else K = 1)
    batch_norm: str      # "ghost" or "exact"
    long: bool = False   # K times the epochs


RUNS = (Run("small", False, "ghost"), Run("large exact", True, "exact"),
        Run("large ghost", True, "ghost"), Run("large ghost long", True, "ghost", long=True))


def parse_args(argv=None):
    p = models.parser(__doc__)
    p.add_argument("--batch-size", type=models.positive_int, default=32,
                   help="examples per micro-batch: the small batch and the ghost batch")
    p.add_argument("--accumulate", type=models.positive_int, default=16, metavar="K",
                   help="micro-batches per update of the large batch")
    p.add_argument("--epochs", type=models.positive_int, default=24,
                   help="epochs of small, large exact and large ghost (K times for long)")
    p.add_argument("--seeds", type=models.positive_int, default=5)
    p.add_argument("--quick", action="store_true", help="2 epochs, 2 seeds (seconds)")
    models.add_flags(p, lr=0.05, momentum=0.9, train_size=None, mode=None, out="out",
                     no_plot=False, no_progress=False)
    return p.parse_args(argv)


def options(run, args):
    """compile_accumulation's keywords of `run` that the runs do not share."""
    k = args.accumulate if run.large else 1
    return dict(every=k, batch_norm=run.batch_norm, running_stats="pooled")


def train(run, seed, data, side, args, result):
    """Train `run`; yields after each epoch and fills `result` (a dict)."""
    X, y, X_test, y_test = data
    x, t, params, loss, (eval_loss, eval_acc) = batch_norm_digits.build(side, seed, run.name)
    opts = options(run, args)
    k = opts["every"]
    epochs = args.epochs * (k if run.long else 1)
    updates = (len(X) // args.batch_size) * epochs // k
    lr = schedules.sqrt_scaling(args.lr, args.batch_size, args.batch_size * k)
    rate = schedules.piecewise_constant(lr, {max(1, 2 * updates // 3): 0.1})
    trainer = compile_accumulation([x, t], loss, params, lasagne_accum.momentum,
                                   dict(learning_rate=rate, momentum=args.momentum),
                                   weight=x.shape[0], mode=args.mode, **opts)
    evaluate = pytensor.function([x, t], [eval_loss, eval_acc],
                                 mode=lasagne_accum.mode(args.mode or "CVM"))
    rng = np.random.default_rng(seed)
    curve = []
    for epoch in range(1, epochs + 1):
        for batch in models.minibatches(X, y, args.batch_size, rng, multiple=args.batch_size):
            trainer.step(*batch)
        curve.append((epoch, trainer.steps, float(evaluate(X_test, y_test)[1])))
        yield
    # a partial last window (none when K divides the micro-batches of the run) is dropped
    test_loss, test_acc = (float(v) for v in evaluate(X_test, y_test))
    result.update(name=run.name, options=opts, lr=lr, epochs=epochs, updates=trainer.steps,
                  planned_updates=updates, examples=trainer.examples, test_loss=test_loss,
                  test_acc=test_acc, train_acc=float(evaluate(X, y)[1]), curve=curve)


def table(results, n_train, args):
    """The table's lines, from the runs' results per seed."""
    small = np.array([r["test_acc"] for r in results["small"]])
    b = args.batch_size
    lines = [f"digits batch-norm CNN, B_S = {b}, B_L = {b * args.accumulate}, "
             f"{n_train // b * b} training examples per epoch, momentum SGD {args.momentum}, "
             f"lr/10 after 2/3 of the updates, {args.seeds} seeds (mean and std)",
             "gap: the small batch's test accuracy minus the run's; train-test: the run's "
             "training accuracy minus its test accuracy (accuracy points)",
             f"{'run':<17} {'batch':>8} {'BN over':>7} {'lr':>6} {'epochs':>6} {'updates':>7} "
             f"{'train %':>7} {'test %':>6} {'std':>5} {'gap':>6} {'std':>5} "
             f"{'train-test':>10} {'std':>5}"]
    for run in RUNS:
        rs = results[run.name]
        first = rs[0]
        k = first["options"]["every"]
        test = 100 * np.array([r["test_acc"] for r in rs])
        train = 100 * np.array([r["train_acc"] for r in rs])
        gap = 100 * small - test
        spread = train - test
        over = b * k if first["options"]["batch_norm"] == "exact" and k > 1 else b
        lines.append(f"{run.name:<17} {f'{b}x{k}':>8} {over:7d} {first['lr']:6.3f} "
                     f"{first['epochs']:6d} {first['updates']:7d} {train.mean():7.2f} "
                     f"{test.mean():6.2f} {test.std():5.2f} {gap.mean():6.2f} {gap.std():5.2f} "
                     f"{spread.mean():10.2f} {spread.std():5.2f}")
    return lines


def main(argv=None):
    args = parse_args(argv)
    if args.quick:
        args.epochs, args.seeds = min(args.epochs, 2), min(args.seeds, 2)
    start = time.perf_counter()
    results = {run.name: [] for run in RUNS}
    n_train = 0

    def work():
        nonlocal n_train
        for seed in range(args.seeds):
            data, side = models.load_data_or_exit(seed, train_size=args.train_size)
            if len(data[0]) < args.batch_size:
                models.fail(f"{len(data[0])} training examples, fewer than one micro-batch "
                            f"of {args.batch_size}")
            n_train = len(data[0])
            for run in RUNS:
                result = {}
                yield from train(run, seed, data, side, args, result)
                results[run.name].append(result)

    total = args.seeds * sum(args.epochs * (args.accumulate if r.long else 1) for r in RUNS)
    for _ in models.progress(work(), total=total, desc="epochs", enabled=not args.no_progress):
        pass
    lines = table(results, n_train, args)
    text = "\n".join(lines)
    def draw(plt):
        left, right = plt.gcf().subplots(1, 2, sharey=True)
        for run in RUNS:
            rs = results[run.name]
            acc = 100 * np.mean([[a for _, _, a in r["curve"]] for r in rs], axis=0)
            epochs = [e for e, _, _ in rs[0]["curve"]]
            updates = [max(u, 1) for _, u, _ in rs[0]["curve"]]
            style = "--" if run.long else "-"
            left.plot(epochs, acc, style, label=run.name)
            right.plot(updates, acc, style, label=run.name)
        left.set(xlabel="epoch", ylabel="test accuracy % (mean over seeds)", xscale="log")
        right.set(xlabel="parameter updates", xscale="log")
        right.legend()
        plt.suptitle(f"digits CNN, ghost batches of {args.batch_size} in a batch of "
                     f"{args.batch_size * args.accumulate}")
        left.set_ylim(max(0, left.get_ylim()[0]), 100)

    models.report(args.out, "ghost_batch_norm", text, None if args.no_plot else draw, start)
    return {"results": results, "lines": lines, "args": args}


if __name__ == "__main__":
    main()
