#!/usr/bin/env python
"""What following the gradient noise scale buys: a batch that grows as B_simple says.

McCandlish et al. 2018 (arXiv 1812.06162) predict the critical batch size by the
gradient noise scale B_simple = tr(Sigma) / |G|^2: a batch below it trains in
proportionally fewer optimizer updates for the same examples, a batch above it
spends examples for few saved updates. The accumulation window measures
B_simple as it trains (``compile_accumulation(noise_scale=...)``), and
``lasagne_accum.FollowNoiseScale`` sets each window's number of micro-batches
K so that the window's batch approaches it (by factors of two, within bounds).

Three runs from the same initial MLP on scikit-learn's digits, micro-batches of
``--batch-size``, Adam: fixed K = 1, fixed K = ``--max-every``, and K following
the noise scale. Each stops when the training loss reaches ``--target``; the
table gives the updates and the examples each needed, the K it ended with and
the noise scale measured there; the plot shows the loss against both.

    python examples/batch_size_noise_scale.py            # about a minute
    python examples/batch_size_noise_scale.py --quick    # seconds
"""

import time

import numpy as np
import pytensor

import lasagne_accum
from lasagne_accum import FollowNoiseScale, compile_accumulation

import models


def parse_args(argv=None):
    p = models.parser(__doc__)
    p.add_argument("--batch-size", type=models.positive_int, default=16,
                   help="examples per micro-batch (b)")
    p.add_argument("--max-every", type=models.positive_int, default=16,
                   help="the upper bound of K, and the K of the large fixed batch")
    p.add_argument("--target", type=models.positive_float, default=0.15,
                   help="training loss each run trains to")
    p.add_argument("--max-epochs", type=models.positive_int, default=60,
                   help="give up after this many epochs")
    p.add_argument("--hidden", type=models.positive_int, default=32, help="hidden units")
    p.add_argument("--quick", action="store_true",
                   help="target loss 0.5 and at most 10 epochs (seconds)")
    models.add_flags(p, lr=3e-3, seed=0, mode=None, out="out", no_progress=True)
    return p.parse_args(argv)


def train(label, every, data, args):
    """One run to the target; its row and its loss curve."""
    X, y = data
    model = models.build_mlp(X.shape[1], args.hidden, 10, args.seed)
    x = model.x
    trainer = compile_accumulation(
        [x, model.y], model.loss, model.params, lasagne_accum.adam, dict(learning_rate=args.lr),
        every=every, weight=x.shape[0], noise_scale=dict(population=len(X)), mode=args.mode)
    evaluate = pytensor.function([x, model.y], model.loss,
                                 mode=lasagne_accum.mode(args.mode or "CVM"))
    rng = np.random.default_rng(args.seed)
    curve = [(0, 0, float(evaluate(X, y)))]
    reached = None
    for _ in range(args.max_epochs):
        for xb, yb in models.minibatches(X, y, args.batch_size, rng):
            steps = trainer.steps
            trainer.step(xb, yb)
            if trainer.steps > steps:
                loss = float(evaluate(X, y))
                curve.append((trainer.steps, trainer.examples, loss))
                if loss <= args.target:
                    reached = trainer.steps, trainer.examples
                    break
        if reached:
            break
    noise = trainer.noise_scale
    return {"label": label, "updates": reached[0] if reached else None,
            "examples": reached[1] if reached else None, "final_k": trainer.window,
            "b_simple": noise, "curve": curve}


def main(argv=None):
    args = parse_args(argv)
    if args.quick:
        args.target, args.max_epochs = max(args.target, 0.5), min(args.max_epochs, 10)
    (X, y, _, _), _ = models.load_data_or_exit(args.seed)
    start = time.perf_counter()
    runs = [("fixed K=1", 1), (f"fixed K={args.max_every}", args.max_every),
            ("follow B_simple", FollowNoiseScale(args.batch_size, min_every=2,
                                                 max_every=args.max_every))]
    print(f"digits MLP 64-{args.hidden}-10, {len(X)} training examples, micro-batches of "
          f"{args.batch_size}, adam lr={args.lr}; each run trains to a training loss of "
          f"{args.target}")
    rows = [train(label, every, (X, y), args) for label, every in runs]
    print(f"{'run':<18} {'updates':>8} {'examples':>9} {'final K':>8} {'B_simple':>9}")
    for r in rows:
        updates = "-" if r["updates"] is None else str(r["updates"])
        examples = "-" if r["examples"] is None else str(r["examples"])
        noise = "-" if r["b_simple"] is None else f"{r['b_simple']:.0f}"
        print(f"{r['label']:<18} {updates:>8} {examples:>9} {r['final_k']:>8} {noise:>9}")
    print("(-: the target was not reached; B_simple: running averages of the window's "
          "estimates, with the finite-data correction; fixed K=1 measures none)")

    def draw(plt):
        fig = plt.gcf()
        left, right = fig.subplots(1, 2, sharey=True)
        for r in rows:
            steps, examples, loss = zip(*r["curve"])
            left.plot(steps, loss, label=r["label"])
            right.plot(examples, loss, label=r["label"])
        left.set(xscale="log", xlabel="optimizer updates", ylabel="training loss",
                 yscale="log")
        right.set(xlabel="examples")
        left.axhline(args.target, color="gray", lw=0.5)
        right.axhline(args.target, color="gray", lw=0.5)
        right.legend()

    path = models.save_plot(f"{models.out_dir(args.out)}/batch_size_noise_scale.png", draw)
    if path:
        print(f"loss curves: {path}")
    print(f"done in {time.perf_counter() - start:.1f} s (compiling included)")
    return rows


if __name__ == "__main__":
    main()
