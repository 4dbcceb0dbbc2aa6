#!/usr/bin/env python
"""The large-batch recipe on digits: linear scaling, warmup and LARS by accumulation.

A small batch B trains an MLP on scikit-learn's bundled 8x8 digits with
Lasagne's momentum rule; then the same model trains with an effective batch
of 16*B, accumulated over 16 calls of batch B (``average=16``: one
optimizer step per 16 mini-batches, so 16x fewer steps for the same epochs):

* (a) with the baseline learning rate,
* (b) with the linear scaling rule of Goyal et al. (2017): the learning rate
  times 16 (:func:`lasagne_accum.schedules.linear_scaling`),
* (c) the same plus their gradual warmup: from the baseline learning rate to
  16 times it over the first epochs
  (:func:`lasagne_accum.schedules.linear_warmup`, a schedule evaluated on
  the rule's own step counter, which advances once per optimizer step),
* (d) LARS (You et al. 2017, :func:`lasagne_accum.lars`) with the same
  warmup shape, biases excluded from the trust ratio and the decay.

Every row starts from the same parameters and sees the same examples in the
same order. The table has one line per row, in the style of
``cross_minibatch.py``::

    (c) scaling+warmup minibatch=8(16) x160 20 iters 0.123456 96.44 lr=0.01->0.16 momentum=0.9

``minibatch=8(16)`` is batch 8 accumulated over 16 calls, ``x160`` the
mini-batches per epoch, ``20 iters`` the epochs, then the test loss and the
test accuracy in percent. Loss curves go to ``OUT/large_batch_recipe.png``.

    python examples/large_batch_recipe.py              # under a minute on a laptop CPU
    python examples/large_batch_recipe.py --epochs 5   # quicker
"""

import argparse
import os
import time

import numpy as np
import pytensor

from lasagne_accum import collect_state, lars, mode, momentum
from lasagne_accum.schedules import linear_scaling, linear_warmup

import models

BATCH, ACCUMULATE, EPOCHS = 8, 16, 20
LR, MOMENTUM, WARMUP_EPOCHS = 0.01, 0.9, 3
LARS_LR, LARS_TRUST, LARS_DECAY = 4.0, 0.001, 1e-4

# (tag, label, accumulate?, learning rate kind, rule)
ROWS = [
    ("base", "baseline", False, "base", "momentum"),
    ("(a)", "baseline-lr", True, "base", "momentum"),
    ("(b)", "linear-scaling", True, "scaled", "momentum"),
    ("(c)", "scaling+warmup", True, "warmup", "momentum"),
    ("(d)", "lars+warmup", True, "lars", "lars"),
]


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description="Batch B against an effective batch 16*B by gradient accumulation on the "
                    "bundled digits: the baseline learning rate, linear scaling, linear "
                    "scaling plus warmup, and LARS.")
    p.add_argument("--epochs", type=models.positive_int, default=EPOCHS,
                   help=f"epochs per row (default {EPOCHS})")
    p.add_argument("--batch", type=models.positive_int, default=BATCH,
                   help=f"the small batch B (default {BATCH})")
    p.add_argument("--accumulate", type=models.positive_int, default=ACCUMULATE,
                   help=f"mini-batches per optimizer step in rows (a)-(d) (default {ACCUMULATE})")
    p.add_argument("--lr", type=models.positive_float, default=LR,
                   help=f"the baseline learning rate for batch B (default {LR:g})")
    p.add_argument("--momentum", type=models.unit_float, default=MOMENTUM,
                   help=f"momentum of every row (default {MOMENTUM:g})")
    p.add_argument("--warmup-epochs", type=float, default=WARMUP_EPOCHS,
                   help=f"length of the warmup of rows (c) and (d), in epochs "
                        f"(default {WARMUP_EPOCHS:g})")
    p.add_argument("--lars-lr", type=models.positive_float, default=LARS_LR,
                   help=f"LARS's peak (global) learning rate (default {LARS_LR:g})")
    p.add_argument("--lars-trust", type=models.positive_float, default=LARS_TRUST,
                   help=f"LARS's trust coefficient (default {LARS_TRUST:g})")
    p.add_argument("--lars-decay", type=float, default=LARS_DECAY,
                   help=f"LARS's weight decay (default {LARS_DECAY:g})")
    p.add_argument("--hidden", type=models.positive_int, default=64,
                   help="hidden units of the MLP (default 64)")
    p.add_argument("--train-size", type=models.positive_int, default=None,
                   help="train on the first N training examples only (default: all)")
    p.add_argument("--rows", default=None,
                   help=f"comma-separated row numbers to run, 1-based (default: all {len(ROWS)})")
    models.add_flags(p, dtype=("float64", models.FLAGS["dtype"][1] + " (default float64)"))
    p.add_argument("--mode", type=models.mode_name, default="CVM",
                   help="PyTensor mode (CVM, NUMBA, ...; default CVM)")
    p.add_argument("--seed", type=int, default=0, help="seed of the data split, the "
                   "initial parameters and the epoch orders (default 0)")
    p.add_argument("--out", default="out", help="directory for the plot (default ./out)")
    p.add_argument("--no-plot", action="store_true", help="do not draw the loss curves")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    if args.warmup_epochs < 0:
        p.error(f"--warmup-epochs must be >= 0, got {args.warmup_epochs:g}")
    if args.lars_decay < 0:
        p.error(f"--lars-decay must be >= 0, got {args.lars_decay:g}")
    args.rows = models.row_numbers(p, args.rows, len(ROWS))
    # Every epoch uses the first multiple of the large batch of a fresh shuffle,
    # so that an epoch is whole optimizer steps in every row.
    args.multiple = args.batch * args.accumulate
    return args


def decimal(x):
    return np.format_float_positional(float(f"{x:.6g}"), trim="-")


class Experiment:
    """One MLP; one compiled function per row kind; every row starts from the same state."""

    def __init__(self, args, n_in, steps_per_epoch):
        self.model = models.build_mlp(n_in, n_hidden=args.hidden, seed=args.seed,
                                        dtype=args.dtype)
        m = self.model
        dtype = m.params[0].type.dtype
        self.lr = pytensor.shared(np.asarray(args.lr, dtype), name="lr")
        biases = [p for p in m.params if p.ndim == 1]
        big = args.batch * args.accumulate
        warmup = int(round(args.warmup_epochs * steps_per_epoch))
        self.scaled_lr = linear_scaling(args.lr, args.batch, big)
        # Goyal et al.: from the baseline rate to the scaled one over the warmup
        self.warmup = linear_warmup(args.lr, self.scaled_lr, warmup)
        self.lars_warmup = linear_warmup(args.lars_lr / args.accumulate, args.lars_lr, warmup)
        rules = {
            "plain": momentum(m.loss, m.params, self.lr, momentum=args.momentum),
            "accumulated": momentum(m.loss, m.params, self.lr, momentum=args.momentum,
                                    average=args.accumulate),
            "warmup": momentum(m.loss, m.params, self.warmup, momentum=args.momentum,
                               average=args.accumulate),
            "lars": lars(m.loss, m.params, self.lars_warmup, momentum=args.momentum,
                         weight_decay=args.lars_decay, trust_coefficient=args.lars_trust,
                         exclude=biases, average=args.accumulate),
        }
        needed = {self.kind(ROWS[n - 1]) for n in args.rows}
        self.train_fns, self.initial = {}, {}
        for kind in needed:
            self.train_fns[kind] = pytensor.function([m.x, m.y], m.loss, updates=rules[kind],
                                                     mode=mode(args.mode))
            for var in collect_state(rules[kind]).values():
                self.initial[var] = var.get_value(borrow=False)
        self.evaluate = m.evaluator(args.mode)

    @staticmethod
    def kind(row):
        _, _, accumulate, lr_kind, _ = row
        if lr_kind == "lars":
            return "lars"
        if lr_kind == "warmup":
            return "warmup"
        return "accumulated" if accumulate else "plain"

    def run(self, data, row, args, desc):
        X_train, y_train, X_test, y_test = data
        for var, value in self.initial.items():
            var.set_value(value.copy())
        lr = self.scaled_lr if row[3] == "scaled" else args.lr
        self.lr.set_value(np.asarray(lr, self.lr.dtype))
        train_fn = self.train_fns[self.kind(row)]
        rng = np.random.RandomState(args.seed)       # the same epoch orders for every row
        curve, diverged = [], None
        bar = models.progress(range(args.epochs), desc=desc, enabled=not args.no_progress)
        for epoch in bar:
            batches = models.minibatches(X_train, y_train, args.batch, rng,
                                         multiple=args.multiple)
            train_loss = np.mean([train_fn(xb, yb) for xb, yb in batches])
            test_loss, test_acc = self.evaluate(X_test, y_test)
            curve.append((float(train_loss), test_loss, test_acc))
            bar.set(f"test loss {test_loss:.4f}")
            if not all(np.isfinite(models.value(p)).all() for p in self.model.params):
                diverged = epoch + 1
                curve += [(np.nan, np.nan, test_acc)] * (args.epochs - len(curve))
                break
        test_loss, test_acc = curve[-1][1:]
        return dict(n_batches=len(batches), test_loss=test_loss, test_acc=100 * test_acc,
                    curve=curve, diverged=diverged)


def lr_text(row, args, experiment):
    kind = row[3]
    if kind == "base":
        return f"lr={decimal(args.lr)}"
    if kind == "scaled":
        return f"lr={decimal(experiment.scaled_lr)}"
    if kind == "warmup":
        return f"lr={decimal(args.lr)}->{decimal(experiment.scaled_lr)}"
    return (f"lr={decimal(args.lars_lr / args.accumulate)}->{decimal(args.lars_lr)} "
            f"trust={decimal(args.lars_trust)}")


def plot(results, path):
    def draw(plt):
        for r in results:
            epochs = np.arange(1, len(r["curve"]) + 1)
            loss = np.array([c[1] for c in r["curve"]])
            style = dict(linewidth=3, alpha=0.6) if r["tag"] == "base" else dict(linewidth=1.5)
            plt.plot(epochs, loss, label=f"{r['tag']} {r['short']}", **style)
        plt.yscale("log")
        plt.xlabel("epoch (the same examples in every row)")
        plt.ylabel("test loss (log scale)")
        plt.title("MLP on 8x8 digits: batch B against 16*B by accumulation", fontsize=10)
        plt.legend(fontsize=8)

    return models.save_plot(path, draw)


def main(argv=None):
    args = parse_args(argv)
    out = None if args.no_plot else models.out_dir(args.out)
    if args.train_size and args.train_size < args.multiple:
        models.fail(f"--train-size must be at least batch * accumulate = {args.multiple}")
    data, side = models.load_data_or_exit(args.seed, args.train_size, dtype=args.dtype)
    big = args.batch * args.accumulate
    used = len(data[0]) - len(data[0]) % args.multiple
    steps_per_epoch = used // big
    print(f"MLP on {len(data[0])} training / {len(data[2])} test digits; batch {args.batch} "
          f"against {big} = {args.batch} x {args.accumulate} accumulated; {args.epochs} epochs "
          f"per row ({used // args.batch} and {steps_per_epoch} optimizer steps per epoch)",
          flush=True)
    start = time.perf_counter()
    experiment = Experiment(args, side * side, steps_per_epoch)
    results = []
    for number in args.rows:
        row = ROWS[number - 1]
        tag, label, accumulate, _, rule = row
        r = experiment.run(data, row, args, desc=f"row {number}/{len(ROWS)}")
        size = f"{args.batch}({args.accumulate})" if accumulate else f"{args.batch}"
        text = lr_text(row, args, experiment)
        r.update(tag=tag, label=label, rule=rule, number=number, lr=text,
                 batch=big if accumulate else args.batch,
                 short=f"{label}, batch {big if accumulate else args.batch}, {text}")
        r["line"] = (f"{tag} {label} minibatch={size} x{r['n_batches']} {args.epochs} iters "
                     f"{r['test_loss']:.6f} {r['test_acc']:.2f} {text} "
                     f"momentum={decimal(args.momentum)}")
        print(r["line"], flush=True)
        results.append(r)
    for r in results:
        if r["diverged"]:
            print(f"note: {r['tag']} {r['label']} diverged (non-finite parameters) in epoch "
                  f"{r['diverged']}; training of that row stopped there")
    png = None
    if not args.no_plot:
        png = plot(results, os.path.join(out, "large_batch_recipe.png"))
        if png:
            print(f"loss curves: {png}")
    print(f"done in {time.perf_counter() - start:.1f} s (compiling included)")
    return dict(rows=results, plot=png)


if __name__ == "__main__":
    main()
