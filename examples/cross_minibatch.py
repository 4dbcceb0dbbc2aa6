#!/usr/bin/env python
"""Batch 1 averaged over 5 batches trains like batch 5: the seed's table, on digits.

The seed discussion trained Lasagne's mnist.py CNN with momentum 0.999 at
learning rate 1e-4 and found that batch 5 converges, plain batch 1 at the same
settings diverges and needs a 10x smaller learning rate, and batch 1 with its
gradients averaged over 5 batches converges like batch 5. This script runs
those rows on scikit-learn's bundled 8x8 digits with the two-function form of
gradient accumulation (:func:`lasagne_accum.accumulate_gradients` and
Lasagne's ``momentum`` on the accumulated gradients) and prints a table in the
seed's format, one line per row::

    control nodrop minibatch=5 x268 8 iters 0.223322 92.87 lr=0.0001 momentum=0.999

``minibatch=1(5)`` is batch 1 averaged over 5 calls, ``x268`` the mini-batches
per epoch, ``8 iters`` the epochs, then the test loss and the test accuracy in
percent (``nan`` loss: the row diverged). Every row starts from the same
parameters and sees the same examples in the same order: each epoch shuffles
the 1348 training digits and uses the first 1340 (a multiple of the largest
window, 10, whichever rows ``--rows`` selects), so the windows of ``1(5)`` are
exactly the batches of ``5``. Loss curves go to ``OUT/cross_minibatch.png``.

One compiled accumulate function and one compiled apply function serve every
row: the window N is only how often the loop calls the apply function, and the
learning rate and momentum are shared variables. The test set is evaluated
with PyTensor's Python implementations (no compiling for 56 calls).

The model is float64 by default. Averaging 5 calls of batch 1 computes the
gradient of the batch of 5 up to rounding (the 5 gradients are summed in
another order), and momentum 0.999 near divergence amplifies rounding
differences over thousands of steps: in float32 they reach the printed digits
(and then differ between CPUs and BLAS builds), in float64 they stay ~1e-10
below them, so the two rows print the same digits on every machine.

    python examples/cross_minibatch.py --quick    # 8 epochs at the seed's lr 1e-4
    python examples/cross_minibatch.py            # 20 epochs at lr 7e-5
"""

import os
import time

import numpy as np
import pytensor

from lasagne_accum import accumulate_gradients, collect_state, mode, momentum

import models

# (kind, batch size, average over, learning rate: "large" or "small", momentum)
ROWS = [
    ("control", 5, 1, "large", 0.999),
    ("control", 1, 1, "large", 0.999),
    ("control", 1, 1, "small", 0.999),
    ("cross", 1, 5, "large", 0.999),
    ("cross", 1, 10, "large", 0.999),
    ("control", 5, 1, "large", 0.995),
    ("cross", 1, 5, "large", 0.995),
]
EPOCHS, LR = 20, 7e-5
QUICK_EPOCHS, QUICK_LR = 8, 1e-4   # the seed's learning rate
# Every epoch uses the first multiple of the largest window of ALL rows (10) of
# a fresh shuffle, so that the windows of batch 1(5) are exactly the batches of
# batch 5, and the data of a row does not depend on which rows --rows selects.
MULTIPLE = int(np.lcm.reduce([batch * average for _, batch, average, _, _ in ROWS]))
DEFAULT_MODE = "CVM"


def parse_args(argv=None):
    p = models.parser(__doc__)
    p.add_argument("--quick", action="store_true",
                   help=f"{QUICK_EPOCHS} epochs at lr {QUICK_LR:g} (unless --epochs or --lr "
                        "are given); the README's main command")
    p.add_argument("--epochs", type=models.positive_int, default=None,
                   help=f"epochs per row (default {EPOCHS}, {QUICK_EPOCHS} with --quick)")
    p.add_argument("--lr", type=models.positive_float, default=None,
                   help=f"the large learning rate (default {LR:g}, {QUICK_LR:g} with --quick)")
    p.add_argument("--small-lr-factor", type=models.positive_float, default=10.0,
                   help="the small learning rate of row 3 is lr divided by this")
    p.add_argument("--model", choices=["cnn", "mlp"], default="cnn",
                   help="the im2col CNN of models.py, or a one-hidden-layer MLP")
    p.add_argument("--dtype", choices=["float64", "float32"], default="float64",
                   help="model precision; float64 makes rows 1 and 4 print the same digits on "
                        "every machine")
    p.add_argument("--train-size", type=models.positive_int, default=None,
                   help=f"train on the first N training examples only, N >= {MULTIPLE} "
                        "(default: all 1348)")
    p.add_argument("--rows", default=None,
                   help=f"comma-separated row numbers to run, 1-based (default: all {len(ROWS)})")
    p.add_argument("--mode", type=models.mode_name, default=DEFAULT_MODE,
                   help="PyTensor mode of the two training functions (C compiles this CNN "
                        "faster than Numba on a cold cache; NUMBA runs its batch-1 step faster)")
    p.add_argument("--no-pch", action="store_true",
                   help="compile the C modules without precompiled headers, as plain PyTensor "
                        "does (a slower cold start, the same code)")
    p.add_argument("--jobs", type=int, default=None,
                   help="C modules compiled at once on a cold cache (default: one per core; "
                        "1: one at a time, as plain PyTensor does)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the initial parameters, the train/test split and the order")
    p.add_argument("--out", default="out", help="directory for the plot")
    p.add_argument("--no-plot", action="store_true", help="do not draw the loss curves")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    if args.epochs is None:
        args.epochs = QUICK_EPOCHS if args.quick else EPOCHS
    if args.lr is None:
        args.lr = QUICK_LR if args.quick else LR
    args.rows = models.row_numbers(p, args.rows, len(ROWS))
    args.multiple = MULTIPLE
    if args.train_size is not None and args.train_size < MULTIPLE:
        p.error(f"--train-size must be at least {MULTIPLE} (the largest window)")
    if args.jobs is not None and args.jobs < 1:
        p.error(f"--jobs must be at least 1, got {args.jobs}")
    return args


def decimal(x):
    """0.00005 rather than 5e-05, as in the seed's table."""
    return np.format_float_positional(float(f"{x:.6g}"), trim="-")


def row_label(kind, batch, average, n_batches, epochs):
    size = f"{batch}({average})" if average > 1 else f"{batch}"
    return f"{kind} nodrop minibatch={size} x{n_batches} {epochs} iters"


class Experiment:
    """One model, two compiled functions for every row, reset between rows.

    ``step`` adds a batch's gradient to the buffers of
    :func:`~lasagne_accum.accumulate_gradients`; ``apply`` runs Lasagne's
    ``momentum`` on their mean and empties them. A row with window N calls
    ``apply`` after every N-th ``step``, so N needs no graph of its own; the
    learning rate and the momentum are shared variables. Before each row every
    shared variable the two functions update (params, velocities, buffers,
    counter: :func:`lasagne_accum.collect_state`) is put back to its initial
    value, so each row starts from the same parameters.
    """

    def __init__(self, args, side, example):
        self.model = models.build_model(args.model, side, seed=args.seed, dtype=args.dtype)
        dtype = self.model.params[0].type.dtype
        self.lr = pytensor.shared(np.asarray(0, dtype), name="lr")
        self.momentum = pytensor.shared(np.asarray(0, dtype), name="momentum")
        params = self.model.params
        accumulate, reset = accumulate_gradients(self.model.loss, params)
        apply = momentum(accumulate.grads, params, self.lr, momentum=self.momentum)
        apply.update(reset)
        self.initial = {var: var.get_value(borrow=False)
                        for var in collect_state(accumulate, apply).values()}
        with models.compiling(f"the accumulate step ({args.mode})"):
            self.step = pytensor.function([self.model.x, self.model.y], self.model.loss,
                                          updates=accumulate, mode=mode(args.mode))
            self.step(*example)       # Numba compiles on the first call; reset() undoes the step
        with models.compiling(f"the momentum apply step ({args.mode})"):
            self.apply = pytensor.function([], [], updates=apply, mode=mode(args.mode))
            self.apply()              # the same (an empty window: changes nothing)
        self.step.trust_input = self.apply.trust_input = True   # batches have the right dtype
        self.evaluate = self.model.evaluator(models.PYTHON_MODE)

    def reset(self, lr, mom):
        for var, value in self.initial.items():
            var.set_value(value.copy())
        self.lr.set_value(np.asarray(lr, self.lr.dtype))
        self.momentum.set_value(np.asarray(mom, self.momentum.dtype))

    def run(self, data, batch, average, lr, mom, args, desc):
        """Train one row from the initial params and the same data order; its results."""
        X_train, y_train, X_test, y_test = data
        self.reset(lr, mom)
        step, apply, params = self.step, self.apply, self.model.params
        rng = np.random.RandomState(args.seed)   # the same epoch orders for every row
        curve, diverged = [], None
        bar = models.progress(range(args.epochs), desc=desc, enabled=not args.no_progress)
        for epoch in bar:
            batches = models.minibatches(X_train, y_train, batch, rng, multiple=args.multiple)
            losses = []
            for i, (xb, yb) in enumerate(batches, 1):
                losses.append(step(xb, yb))
                if i % average == 0:          # every epoch holds whole windows
                    apply()
            test_loss, test_acc = self.evaluate(X_test, y_test)
            curve.append((float(np.mean(losses)), test_loss, test_acc))
            bar.set(f"test loss {test_loss:.4f}")
            if not all(np.isfinite(models.value(p)).all() for p in params):
                diverged = epoch + 1       # NaN/inf parameters never recover: stop here
                curve += [(np.nan, np.nan, test_acc)] * (args.epochs - len(curve))
                break
        test_loss, test_acc = curve[-1][1:]
        return dict(n_batches=len(batches), test_loss=test_loss, test_acc=100 * test_acc,
                    curve=curve, diverged=diverged)


# one colour per row of ROWS; the dashed rows (4, 5, 7) dark, their solid partners light
COLORS = ["tab:blue", "tab:orange", "tab:green", "black", "tab:purple", "tab:olive", "tab:red"]


def plot(results, path):
    def draw(plt):
        for r in results:
            epochs = np.arange(1, len(r["curve"]) + 1)
            loss = np.array([c[1] for c in r["curve"]])
            # A dashed row usually lies exactly on a solid one: thin dashes with
            # open circles in a dark colour, drawn on top of a wide pale band.
            style = (dict(linestyle=(0, (4, 2)), linewidth=1.6, marker="o", markersize=6,
                          markerfacecolor="white", markeredgewidth=1.5, zorder=3)
                     if r["kind"] == "cross" else dict(linewidth=6, alpha=0.4, zorder=2))
            line, = plt.plot(epochs, loss, label=r["short"], color=COLORS[r["number"] - 1],
                             **style)
            if r["diverged"]:
                last = r["diverged"] - 1
                if last > 0:
                    plt.plot(epochs[last - 1], loss[last - 1], "x", color=line.get_color(),
                             markersize=12, markeredgewidth=3)
        plt.yscale("log")
        plt.xlabel("epoch")
        plt.ylabel("test loss (log scale)")
        note = ("; x: last finite loss before divergence"
                if any(r["diverged"] for r in results) else "")
        plt.title("Lasagne's momentum on 8x8 digits: batch 1 averaged over N (dashed, o)"
                  f"\nvs plain batches (wide bands){note}", fontsize=10)
        plt.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=2)

    return models.save_plot(path, draw)


def main(argv=None):
    args = parse_args(argv)
    out = None if args.no_plot else models.out_dir(args.out)   # fail early, not after training
    data, side = models.load_data_or_exit(args.seed, args.train_size, dtype=args.dtype)
    small_lr = args.lr / args.small_lr_factor
    print(f"{args.model.upper()} on {len(data[0])} training / {len(data[2])} test digits "
          f"({side}x{side}), Lasagne's momentum; lr={decimal(args.lr)}, "
          f"small lr={decimal(small_lr)}; {args.epochs} epochs per row", flush=True)
    # g++ parses Python's and numpy's headers once, not once per C module, and
    # runs on several of a function's modules at once (tools/fastcompile.py)
    models.fast_compiles(not args.no_pch, args.jobs)
    start = time.perf_counter()
    experiment = Experiment(args, side, (data[0][:1], data[1][:1]))
    results = []
    for number in args.rows:
        kind, batch, average, which, mom = ROWS[number - 1]
        lr = args.lr if which == "large" else small_lr
        r = experiment.run(data, batch, average, lr, mom, args,
                           desc=f"row {number}/{len(ROWS)}")
        r.update(kind=kind, batch=batch, average=average, lr=lr, momentum=mom, number=number)
        r["label"] = row_label(kind, batch, average, r["n_batches"], args.epochs)
        r["short"] = (f"batch {batch}" + (f" averaged over {average}" if average > 1 else "")
                      + f", lr={decimal(lr)}, momentum={mom}")
        r["line"] = (f"{r['label']} {r['test_loss']:.6f} {r['test_acc']:.2f} "
                     f"lr={decimal(lr)} momentum={mom}")
        print(r["line"], flush=True)
        results.append(r)

    for r in results:
        if r["diverged"]:
            print(f"note: {r['short']} diverged (non-finite parameters) in epoch "
                  f"{r['diverged']}; training of that row stopped there")
    verdict = same = None
    by_key = {(r["batch"], r["average"], r["lr"], r["momentum"]): r for r in results}
    b5, b1x5 = by_key.get((5, 1, args.lr, 0.999)), by_key.get((1, 5, args.lr, 0.999))
    if b5 and b1x5:
        gap = abs(b1x5["test_acc"] - b5["test_acc"])
        verdict = gap <= 1.0
        printed = [f"{r['test_loss']:.6f} {r['test_acc']:.2f}" for r in (b1x5, b5)]
        same = printed[0] == printed[1]
        print(f"batch 1 averaged over 5 ({b1x5['test_acc']:.2f}%) is "
              f"{'within' if verdict else 'NOT within'} 1 accuracy point of batch 5 "
              f"({b5['test_acc']:.2f}%): difference {gap:.2f}; test loss and accuracy "
              + ("the same to every printed digit" if same else
                 f"differ in the printed digits ({printed[0]} against {printed[1]})"))
    png = None
    if not args.no_plot:
        png = plot(results, os.path.join(out, "cross_minibatch.png"))
        if png:
            print(f"loss curves: {png}")
    print(f"done in {time.perf_counter() - start:.1f} s (compiling included)")
    return dict(rows=results, within_one_point=verdict, same_digits=same, plot=png)


if __name__ == "__main__":
    main()
