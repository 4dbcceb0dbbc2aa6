#!/usr/bin/env python
"""Steps to a target against the batch size, and the critical batch size (Shallue, McCandlish).

Shallue et al. 2018 ("Measuring the Effects of Data Parallelism on Neural Network
Training", arXiv 1811.03600) find that the fewest steps S(B) to reach a target error
fall as 1/B for small batches (perfect scaling), then level off (diminishing returns)
past a critical batch size. McCandlish et al. 2018 ("An Empirical Model of Large-Batch
Training", arXiv 1812.06162) model the trade-off between steps S and examples E = S B as

    (S / S_min - 1) (E / E_min - 1) = 1,   that is   S(B) = S_min + E_min / B,

with the critical batch size B_crit = E_min / S_min, and predict it from the gradient
noise scale B_simple = tr(Sigma) / |G|^2, measured near the target: of the same order.

The run, on scikit-learn's digits (a 64-``--hidden``-10 MLP, micro-batches of
``--batch-size``):

* batch sizes B = b K for K = 1, 2, 4, ... (``--powers`` powers of two), one compiled
  function for all of them: K is a run-time value (``compile_accumulation(every=...)``)
  and so are the learning rate and the momentum (shared variables);
* for each B, momentum SGD tuned on the grid ``--lrs`` x ``--momenta`` (momentum 0 is
  plain SGD, reported separately), each run from the same initial weights on the same
  stream of examples; S(B) is the fewest optimizer steps after which the held-out error
  is at most ``--target`` (runs stop after ``--max-epochs``);
* the fit of S(B) = S_min + E_min / B (least squares on log S), its R^2 on log S, and
  the slope of log S against log B below B_crit / 4 (perfect scaling: -1);
* B_simple from the accumulation window's noise estimates (``noise_scale``, with the
  finite-population correction for the training set): at the weights where the tuned
  run at the batch size nearest B_crit reaches the target, ``--noise-windows`` windows
  of ``--noise-k`` micro-batches at learning rate 0 (they measure, nothing moves).

Prints the table of S(B) and the fits; writes it to ``OUT/steps_to_target.txt`` and the
log-log plot of S against B (the fit, B_crit and B_simple marked) to
``OUT/steps_to_target.png``.

    python examples/steps_to_target.py            # minutes on 2 cores
    python examples/steps_to_target.py --quick    # seconds: 4 batch sizes, 3 rates
"""

import math
import time

import numpy as np
import pytensor
from scipy.optimize import least_squares

import lasagne_accum
from lasagne_accum import collect_state, compile_accumulation

import models

LRS = [0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0]


def float_list(text):
    try:
        values = [float(v) for v in text.split(",")]
    except ValueError:
        models.fail(f"expected numbers separated by commas, got {text!r}")
    if not values or any(not math.isfinite(v) or v < 0 for v in values):
        models.fail(f"expected finite numbers >= 0, got {text!r}")
    return values


def parse_args(argv=None):
    p = models.parser(__doc__)
    p.add_argument("--batch-size", type=models.positive_int, default=2,
                   help="examples per micro-batch b (B = b K)")
    p.add_argument("--powers", type=models.positive_int, default=9,
                   help="batch sizes B = b, 2b, 4b, ...: how many")
    p.add_argument("--lrs", type=float_list, default=LRS, help="learning-rate grid")
    p.add_argument("--momenta", type=float_list, default=[0.0, 0.9],
                   help="momentum grid; 0 is plain SGD, reported as its own curve")
    p.add_argument("--metric", choices=["loss", "error"], default="loss",
                   help="what the target is on: the held-out cross-entropy, or error rate")
    p.add_argument("--target", type=models.positive_float, default=0.15,
                   help="the held-out loss (or error) to reach")
    p.add_argument("--max-epochs", type=models.positive_int, default=100,
                   help="a run that has not reached the target by then counts as never")
    p.add_argument("--hidden", type=models.positive_int, default=64)
    p.add_argument("--noise-k", type=models.positive_int, default=64,
                   help="micro-batches per noise-measuring window")
    p.add_argument("--noise-windows", type=models.positive_int, default=40)
    p.add_argument("--quick", action="store_true",
                   help="4 batch sizes from b=8, 3 learning rates, momentum 0.9 only "
                   "(seconds)")
    models.add_flags(p, seed=0, mode=None, out="out", no_progress=False)
    args = p.parse_args(argv)
    if any(m >= 1 for m in args.momenta):
        p.error("--momenta: every momentum must be below 1")
    if any(lr <= 0 for lr in args.lrs):
        p.error("--lrs: every learning rate must be positive")
    return args


def stream(X, y, b, seed):
    """Micro-batches of b from reshuffled epochs, forever (the same for every run)."""
    rng = np.random.default_rng(seed)
    while True:
        yield from models.minibatches(X, y, b, rng, multiple=b)


class Sweep:
    """One trainer for every (K, learning rate, momentum), restarted for each run."""

    def __init__(self, data, args):
        X, y, X_val, y_val = data
        self.data, self.args = data, args
        model = models.build_mlp(X.shape[1], args.hidden, 10, args.seed)
        self.lr = pytensor.shared(np.float32(0.1), name="lr")
        self.mom = pytensor.shared(np.float32(0.9), name="momentum")
        self.k = 1
        self.trainer = compile_accumulation(
            [model.x, model.y], model.loss, model.params, lasagne_accum.momentum,
            dict(learning_rate=self.lr, momentum=self.mom), every=lambda examples: self.k,
            weight=model.x.shape[0], noise_scale=dict(population=len(X)), mode=args.mode)
        measure = model.loss if args.metric == "loss" else 1 - model.accuracy
        self.measure = pytensor.function([model.x, model.y], measure,
                                         mode=lasagne_accum.mode(args.mode or "CVM"))
        # everything the trainer updates, at its starting value
        self.state = collect_state(self.trainer)
        self.start = {name: v.get_value(borrow=False) for name, v in self.state.items()}

    def restart(self, k, lr, momentum):
        for name, v in self.state.items():
            v.set_value(self.start[name].copy())
        trainer = self.trainer
        trainer.steps, trainer.examples, trainer.window = 0, 0, 0
        trainer.flush()   # nothing pending: the counter was reset with the rest
        self.k = k
        self.lr.set_value(np.float32(lr))
        self.mom.set_value(np.float32(momentum))

    def steps_to_target(self, k, lr, momentum):
        """The fewest steps to the held-out target, or None within --max-epochs."""
        X, y, X_val, y_val = self.data
        args, trainer = self.args, self.trainer
        self.restart(k, lr, momentum)
        limit = args.max_epochs * len(X)
        for batch in stream(X, y, args.batch_size, args.seed):
            steps = trainer.steps
            trainer.step(*batch)
            if trainer.steps > steps:
                value = float(self.measure(X_val, y_val))
                if not math.isfinite(value):
                    return None
                if value <= args.target:
                    return trainer.steps
                if trainer.examples >= limit:
                    return None
        return None   # not reached: the stream is endless

    def noise_scale(self, k, lr, momentum):
        """B_simple at the weights where this run reaches the target.

        None if the run does not reach it, or if the windows' mean |G|^2 estimate is not
        positive (unbiased, it can fall below 0 when the noise dominates: more windows).
        """
        X, y = self.data[:2]
        args, trainer = self.args, self.trainer
        if self.steps_to_target(k, lr, momentum) is None:
            return None
        self.k = args.noise_k
        self.lr.set_value(np.float32(0))     # the windows measure; nothing moves
        self.mom.set_value(np.float32(0))
        grad_sq, trace = [], []
        batches = stream(X, y, args.batch_size, args.seed + 1)
        while len(grad_sq) < args.noise_windows:
            steps = trainer.steps
            trainer.step(*next(batches))
            if trainer.steps > steps:
                grad_sq.append(trainer.gradient_noise.grad_sq)
                trace.append(trainer.gradient_noise.trace)
        if np.mean(grad_sq) <= 0:   # too few windows to resolve |G|^2 from the noise
            return None
        return float(np.mean(trace) / np.mean(grad_sq))


def fit(batches, steps):
    """S(B) = S_min + E_min / B by least squares on log S; (S_min, E_min, R^2 on log S)."""
    B, S = np.asarray(batches, float), np.asarray(steps, float)

    def residual(theta):
        s_min, e_min = np.exp(theta)
        return np.log(s_min + e_min / B) - np.log(S)

    guess = np.log([max(S.min() / 2, 1e-3), max(S[0] * B[0] / 2, 1e-3)])
    theta = least_squares(residual, guess).x
    s_min, e_min = np.exp(theta)
    total = np.sum((np.log(S) - np.log(S).mean()) ** 2)
    r2 = 1 - np.sum(residual(theta) ** 2) / total if total > 0 else float("nan")
    return float(s_min), float(e_min), float(r2)


def slope_below(batches, steps, limit):
    """The slope of log S against log B over the batch sizes up to `limit` (2 or more)."""
    B, S = np.asarray(batches, float), np.asarray(steps, float)
    low = B <= limit
    if low.sum() < 2:
        return None
    return float(np.polyfit(np.log(B[low]), np.log(S[low]), 1)[0])


def main(argv=None):
    args = parse_args(argv)
    if args.quick:
        args.batch_size = max(args.batch_size, 8)
        args.powers = min(args.powers, 4)
        args.lrs = [lr for lr in (0.05, 0.2, 0.5) if lr in args.lrs] or args.lrs[:3]
        args.momenta = [0.9] if 0.9 in args.momenta else args.momenta[:1]
        args.max_epochs = min(args.max_epochs, 10)
        args.noise_windows = min(args.noise_windows, 5)
        args.noise_k = min(args.noise_k, 16)
    start = time.perf_counter()
    data, _ = models.load_data_or_exit(args.seed)
    sweep = Sweep(data, args)
    ks = [2 ** i for i in range(args.powers)]
    curves = {("sgd" if m == 0 else "momentum"): [m] for m in args.momenta if m == 0}
    if any(m > 0 for m in args.momenta):
        curves["momentum"] = [m for m in args.momenta if m > 0]
    runs = [(k, lr, m) for k in ks for lr in args.lrs for ms in curves.values() for m in ms]
    found = {}
    for k, lr, m in models.progress(runs, desc="runs", enabled=not args.no_progress):
        found[k, lr, m] = sweep.steps_to_target(k, lr, m)

    b = args.batch_size
    results = {}
    lines = [f"digits MLP 64-{args.hidden}-10, micro-batches b={b}, target held-out "
             f"{args.metric} {args.target:g}, learning rates {args.lrs}, momenta {args.momenta}, "
             f"at most {args.max_epochs} epochs",
             f"{'B':>6} " + " ".join(f"{name + ' S':>12} {'lr':>6} {'mom':>5}"
                                     for name in curves)]
    for k in ks:
        row = f"{b * k:6d} "
        for name, momenta in curves.items():
            tried = [(found[k, lr, m], lr, m) for lr in args.lrs for m in momenta
                     if found[k, lr, m] is not None]
            best = min(tried) if tried else None
            results.setdefault(name, {})[b * k] = best
            row += (f"{best[0]:12d} {best[1]:6g} {best[2]:5g} " if best
                    else f"{'never':>12} {'-':>6} {'-':>5} ")
        lines.append(row.rstrip())

    fits = {}
    for name, by_batch in results.items():
        points = [(B, best[0]) for B, best in by_batch.items() if best is not None]
        if len(points) < 3:
            lines.append(f"{name}: fewer than 3 batch sizes reached the target; no fit")
            continue
        s_min, e_min, r2 = fit(*zip(*points))
        b_crit = e_min / s_min
        slope = slope_below(*zip(*points), b_crit / 4)
        fits[name] = dict(s_min=s_min, e_min=e_min, b_crit=b_crit, r2=r2, slope=slope,
                          points=points)
        lines.append(f"{name}: S_min {s_min:.1f} steps, E_min {e_min:.0f} examples, "
                     f"B_crit {b_crit:.0f}, R^2 {r2:.3f} (log S), slope below B_crit/4 "
                     + (f"{slope:.2f}" if slope is not None else "n/a (under 2 points)"))

    b_simple = None
    ref = fits.get("momentum") or next(iter(fits.values()), None)
    if ref is not None:
        name = "momentum" if "momentum" in fits else next(iter(fits))
        near = min(results[name], key=lambda B: abs(math.log(B / ref["b_crit"]))
                   if results[name][B] else math.inf)
        _, lr, m = results[name][near]
        b_simple = sweep.noise_scale(near // b, lr, m)
        if b_simple is not None:
            lines.append(f"B_simple {b_simple:.0f} at the target (the {name} run at B={near}; "
                         f"{args.noise_windows} windows of {args.noise_k}x{b}), "
                         f"B_simple / B_crit {b_simple / ref['b_crit']:.2f}")
        else:
            lines.append(f"B_simple not resolved at B={near}: more --noise-windows")
    table = "\n".join(lines)
    def draw(plt):
        ax = plt.gca()
        for (name, f), color in zip(fits.items(), ("C0", "C1")):
            B, S = zip(*f["points"])
            ax.loglog(B, S, "o", color=color, label=f"{name}: fewest steps")
            grid = np.geomspace(min(B), max(B), 100)
            ax.loglog(grid, f["s_min"] + f["e_min"] / grid, "-", color=color,
                      label=f"S_min + E_min/B (R^2 {f['r2']:.2f})")
            ax.axvline(f["b_crit"], color=color, ls=":", label=f"B_crit {f['b_crit']:.0f}")
        if b_simple is not None:
            ax.axvline(b_simple, color="k", ls="--", label=f"B_simple {b_simple:.0f}")
        ax.set(xlabel="batch size B", ylabel=f"steps to held-out {args.metric} {args.target:g}")
        ax.legend(fontsize=8)

    models.report(args.out, "steps_to_target", table, draw, start)
    return {"results": results, "fits": fits, "b_simple": b_simple, "found": found}


if __name__ == "__main__":
    main()
