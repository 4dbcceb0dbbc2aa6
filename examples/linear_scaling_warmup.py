#!/usr/bin/env python
"""Linear scaling with gradual warm-up for a K times larger batch (Goyal et al. 2017).

Goyal, Dollar, Girshick, Noordhuis, Wesolowski, Kyrola, Tulloch, Jia and He,
"Accurate, Large Minibatch SGD: Training ImageNet in 1 Hour" (arXiv 1706.02677): when
the minibatch is multiplied by K, multiply the learning rate by K; with a gradual warm-up
of the rate from the base value to K times it over the first epochs, the large batch
reaches the small batch's accuracy, and its training loss follows the small batch's
after the first epochs, where without the warm-up it stays well above it early on.

Runs of ``--epochs`` epochs on scikit-learn's digits, per seed, from the same initial
MLP and the same micro-batches of ``--batch-size`` in the same order, momentum SGD
(momentum 0.9, the paper's), the rate constant after any warm-up (the paper's later
step decays are left out):

* ``K=1 base``: one micro-batch per update, the base rate ``--lr``;
* ``K=k no warm-up``: k micro-batches per update (``compile_accumulation(every=k,
  weight=...)``: the mean gradient of k * batch-size examples), the rate k * lr
  (``schedules.linear_scaling``) from the first update on;
* ``K=k warm-up``: the same, the rate rising linearly from lr to k * lr over the first
  ``--warmup-epochs`` epochs (``schedules.linear_warmup(..., unit="examples")``, keyed in
  the examples applied, so the first update uses lr), for each k of ``--ks``.

The training loss is each micro-batch's mean cross-entropy as it goes into a window (at
the parameters of that moment), averaged per example. Since every run sees the same
micro-batches in the same order, two runs are compared at equal examples:

* early gap: a run's mean training loss over the first ``--gap-epochs`` epochs minus the
  ``K=1 base`` run's over the same examples (per seed; mean and standard deviation over
  the seeds). The warm-up closes the gap when its row is near 0 and below the no-warm-up
  row;
* final gap: the same over the last epoch.

Prints the table (test accuracy after the last epoch, mean and standard deviation over
``--seeds`` seeds; the updates of one run; the two gaps) and writes it to
``OUT/linear_scaling_warmup.txt``, with the training loss against epochs (mean over the
seeds, log scale; the right panel the first ``--gap-epochs`` epochs) in
``OUT/linear_scaling_warmup.png``.

    python examples/linear_scaling_warmup.py            # about half a minute
    python examples/linear_scaling_warmup.py --quick    # seconds
"""

import argparse
import time

import numpy as np

import lasagne_accum
from lasagne_accum import compile_accumulation, schedules

import models

BINS = 4      # points per epoch on the plot


def k_list(text):
    """argparse type: comma-separated integers >= 2."""
    try:
        ks = [int(k) for k in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
    if not ks or any(k < 2 for k in ks):
        raise argparse.ArgumentTypeError(f"every K must be >= 2, got {text}")
    return ks


def parse_args(argv=None):
    p = models.parser(__doc__)
    p.add_argument("--epochs", type=models.positive_int, default=30)
    p.add_argument("--seeds", type=models.positive_int, default=5)
    p.add_argument("--batch-size", type=models.positive_int, default=8,
                   help="examples per micro-batch: the K=1 batch")
    p.add_argument("--ks", type=k_list, default=[16, 32],
                   help="the large batches, in micro-batches per update (default: 16,32)")
    p.add_argument("--warmup-epochs", type=models.positive_float, default=2.0,
                   help="length of the gradual warm-up, in epochs")
    p.add_argument("--gap-epochs", type=models.positive_float, default=5.0,
                   help="the early-training window of the loss gap, in epochs")
    p.add_argument("--hidden", type=models.positive_int, default=64)
    p.add_argument("--quick", action="store_true", help="6 epochs, 2 seeds (seconds)")
    models.add_flags(p, lr=(0.025, "the base learning rate, for K=1 (default: 0.025)"),
                     mode=None, out="out", no_progress=False)
    return p.parse_args(argv)


def run_names(ks):
    return ["K=1 base"] + [f"K={k} {w}" for k in ks for w in ("no warm-up", "warm-up")]


def schedule(name, args, n):
    """K and the learning rate (a number or a schedule) of run `name`; `n` examples an epoch."""
    k = int(name.split()[0][2:])
    scaled = schedules.linear_scaling(args.lr, args.batch_size, k * args.batch_size)
    if k == 1:
        return k, args.lr
    if name.endswith("no warm-up"):
        return k, scaled
    # Goyal et al.'s gradual warm-up: from lr at the first update to k * lr, keyed in the
    # examples applied (the rule's counter advances by each window's total weight)
    warmup = int(round(args.warmup_epochs * n))
    return k, schedules.linear_warmup(args.lr, scaled, warmup, unit="examples")


def lr_text(name, args):
    _, lr = schedule(name, args, 1)
    if callable(lr):
        return f"{lr.init_value:g}->{lr.peak_value:g}"
    return f"{lr:g}"


def run(name, seed, data, args):
    """One run: its per-micro-batch losses and sizes, test accuracy, updates, first step."""
    X, y, X_test, y_test = data
    k, lr = schedule(name, args, len(X))
    model = models.build_mlp(X.shape[1], args.hidden, 10, seed)
    trainer = compile_accumulation([model.x, model.y], model.loss, model.params,
                                   lasagne_accum.momentum, dict(learning_rate=lr, momentum=0.9),
                                   every=k, weight=model.x.shape[0], mode=args.mode)
    evaluate = model.evaluator(models.PYTHON_MODE)
    initial = [p.get_value() for p in model.params]
    rng = np.random.default_rng(seed)        # the same micro-batches in every run of a seed
    losses, sizes, first_step, diverged = [], [], None, None
    for epoch in range(args.epochs):
        for batch in models.minibatches(X, y, args.batch_size, rng):
            losses.append(float(trainer.step(*batch)))
            sizes.append(len(batch[1]))
            if first_step is None and trainer.steps == 1:
                first_step = float(np.sqrt(sum(np.sum((p.get_value() - v) ** 2)
                                               for p, v in zip(model.params, initial))))
        if diverged is None and not np.isfinite(losses[-1]):
            diverged = epoch + 1
    trainer.flush()
    _, accuracy = evaluate(X_test, y_test)
    return {"losses": np.array(losses), "sizes": np.array(sizes), "accuracy": accuracy,
            "updates": trainer.steps, "first_step": first_step, "diverged": diverged}


def mean_loss(r, start, stop):
    """Mean training loss per example over the micro-batches that start in [start, stop)."""
    seen = np.concatenate([[0], np.cumsum(r["sizes"])[:-1]])
    inside = (seen >= start) & (seen < stop)
    return float(np.sum(r["losses"][inside] * r["sizes"][inside]) / np.sum(r["sizes"][inside]))


def main(argv=None):
    args = parse_args(argv)
    if args.quick:
        args.epochs, args.seeds = min(args.epochs, 6), min(args.seeds, 2)
    args.gap_epochs = min(args.gap_epochs, args.epochs)
    start = time.perf_counter()
    names = run_names(args.ks)
    results = {name: [] for name in names}
    jobs = [(seed, name) for seed in range(args.seeds) for name in names]
    bar = models.progress(jobs, desc="runs", enabled=not args.no_progress)
    data = None
    for seed, name in bar:
        if name == names[0]:
            data, _ = models.load_data_or_exit(seed)
        bar.set(f"seed {seed} {name}")
        results[name].append(run(name, seed, data, args))
    n = len(data[0])
    early, last = (0, args.gap_epochs * n), ((args.epochs - 1) * n, args.epochs * n)
    for name in names:
        for r, base in zip(results[name], results[names[0]]):
            r["early_gap"] = mean_loss(r, *early) - mean_loss(base, *early)
            r["final_gap"] = mean_loss(r, *last) - mean_loss(base, *last)
    lines = [f"digits MLP 64-{args.hidden}-10, {n} training examples, {args.epochs} epochs, "
             f"micro-batches of {args.batch_size}, momentum SGD (0.9), base lr {args.lr:g}, "
             f"warm-up {args.warmup_epochs:g} epochs, {args.seeds} seeds",
             f"early gap: mean training loss over the first {args.gap_epochs:g} epochs minus "
             f"the K=1 run's on the same examples; final gap: the same over the last epoch",
             f"{'run':<16} {'K':>3} {'batch':>5} {'lr':>12} {'updates':>7} {'test acc %':>10} "
             f"{'std':>5} {'early gap':>9} {'std':>6} {'final gap':>9} {'std':>6}"]
    for name in names:
        rs = results[name]
        acc = 100 * np.array([r["accuracy"] for r in rs])
        gap = np.array([r["early_gap"] for r in rs])
        final = np.array([r["final_gap"] for r in rs])
        k = schedule(name, args, n)[0]
        lines.append(f"{name:<16} {k:3d} {k * args.batch_size:5d} {lr_text(name, args):>12} "
                     f"{rs[0]['updates']:7d} {acc.mean():10.2f} {acc.std():5.2f} "
                     f"{gap.mean():+9.4f} {gap.std():6.4f} {final.mean():+9.4f} "
                     f"{final.std():6.4f}")
    diverged = [f"{name} (seed {seed}, epoch {r['diverged']})" for name in names
                for seed, r in enumerate(results[name]) if r["diverged"]]
    if diverged:
        lines.append("diverged (non-finite training loss): " + ", ".join(diverged))
    table = "\n".join(lines)
    def curve(name):
        """Mean over the seeds of the training loss per 1/BINS epoch."""
        edges = np.arange(args.epochs * BINS + 1) * n / BINS
        return np.mean([[mean_loss(r, a, b) for a, b in zip(edges[:-1], edges[1:])]
                        for r in results[name]], axis=0)

    def draw(plt):
        fig = plt.gcf()
        left, right = fig.subplots(1, 2, sharey=True)
        x = (np.arange(args.epochs * BINS) + 0.5) / BINS
        zoom = x <= args.gap_epochs
        colors = dict(zip(args.ks, plt.rcParams["axes.prop_cycle"].by_key()["color"]))
        for name in names:
            loss = curve(name)
            k = schedule(name, args, n)[0]
            style = dict(color=colors.get(k, "black"), linewidth=2 if k == 1 else 1.5,
                         linestyle="--" if name.endswith("no warm-up") else "-")
            left.plot(x, loss, label=f"{name} ({lr_text(name, args)})", **style)
            right.plot(x[zoom], loss[zoom], **style)
        left.set(xlabel="epoch (the same examples in every run)",
                 ylabel="training loss (mean over seeds)", yscale="log")
        right.set(xlabel=f"epoch (the first {args.gap_epochs:g})")
        right.axvline(args.warmup_epochs, color="grey", linewidth=0.8, linestyle=":",
                      label="end of the warm-up")
        right.legend(fontsize=8)
        left.legend(fontsize=8)
        fig.suptitle(f"linear scaling with and without warm-up: batch {args.batch_size} "
                     f"x K, lr {args.lr:g} x K", fontsize=10)

    models.report(args.out, "linear_scaling_warmup", table, draw, start)
    return results


if __name__ == "__main__":
    main()
