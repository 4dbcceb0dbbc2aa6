#!/usr/bin/env python
"""A digits CNN with batch normalisation under accumulation: ghost batches or the exact batch.

The CNN of ``models.py`` (a 3x3 convolution, 2x2 max-pooling, a dense layer) with a
batch-norm layer after the convolution and after the dense layer, trained with
micro-batches of ``--batch-size`` accumulated ``--accumulate`` times (momentum SGD),
three ways from the same seed and the same examples in the same order:

* ``ghost``: each micro-batch normalised with its own statistics, the running averages
  moved per micro-batch (what a multi-device run with per-device batch norm computes,
  Hoffer et al. 2017, arXiv 1705.08741; Goyal et al. 2017, arXiv 1706.02677);
* ``ghost-pooled``: the same training, the running averages moved once per window with
  the window's pooled statistics;
* ``exact``: the whole window's statistics (``batch_norm="exact"``: one device holding
  the large batch, or SyncBatchNorm).

Prints the test loss and accuracy (the running statistics, ``deterministic=True``) after
each epoch, and how far the ghost parameters are from the exact ones at the end.

    python examples/batch_norm_digits.py            # about a minute
    python examples/batch_norm_digits.py --quick    # seconds
"""

import time

import numpy as np
import pytensor
import pytensor.tensor as pt

import lasagne_accum
from lasagne_accum import compile_accumulation

import models


def parse_args(argv=None):
    p = models.parser(__doc__)
    p.add_argument("--batch-size", type=models.positive_int, default=16,
                   help="examples per micro-batch")
    p.add_argument("--accumulate", type=models.positive_int, default=4, metavar="K",
                   help="micro-batches per optimizer step")
    p.add_argument("--epochs", type=models.positive_int, default=6)
    p.add_argument("--quick", action="store_true", help="2 epochs on 400 examples")
    models.add_flags(p, lr=0.05, seed=0, mode=None)
    return p.parse_args(argv)


def build(side, seed, kind):
    """The CNN with two batch-norm layers; training and evaluation graphs."""
    rng = np.random.RandomState(seed)

    def shared(value, name):
        return pytensor.shared(np.asarray(value, "float32"), name=name)

    k, filters, hidden = 3, 8, 32
    conv = shared(rng.randn(k * k, filters) * np.sqrt(2 / (k * k)), "conv")
    ho = side - k + 1
    flat = (ho // 2) * (ho // 2) * filters
    dense = shared(rng.randn(flat, hidden) * np.sqrt(2 / flat), "dense")
    out_W, out_b = shared(rng.randn(hidden, 10) * np.sqrt(1 / hidden), "out_W"), \
        shared(np.zeros(10), "out_b")
    bn = [(shared(np.ones(n), f"gamma{i}"), shared(np.zeros(n), f"beta{i}"),
           shared(np.zeros(n), f"{kind}.mean{i}"), shared(np.ones(n), f"{kind}.var{i}"))
          for i, n in enumerate((filters, hidden))]
    x, y = pt.matrix("x", dtype="float32"), pt.vector("y", dtype="int64")

    def forward(deterministic):
        images = x.reshape((x.shape[0], side, side, 1))
        maps = models.conv2d(images, conv, pt.zeros(filters, dtype="float32"), k, side, side)
        maps = lasagne_accum.batch_norm(maps, *bn[0], axes=(0, 1, 2),
                                        deterministic=deterministic)
        pooled = models.max_pool_2x2(pt.maximum(maps, 0), ho, ho)
        h = pooled.reshape((x.shape[0], flat)) @ dense
        h = pt.maximum(lasagne_accum.batch_norm(h, *bn[1], deterministic=deterministic), 0)
        logits = h @ out_W + out_b
        logp = logits - pt.logsumexp(logits, axis=1, keepdims=True)
        loss = -logp[pt.arange(y.shape[0]), y].mean()
        return loss, pt.eq(pt.argmax(logits, axis=1), y).mean()

    params = [conv, dense, out_W, out_b] + [v for g, b, _, _ in bn for v in (g, b)]
    return x, y, params, forward(False)[0], forward(True)


def main(argv=None):
    args = parse_args(argv)
    if args.quick:
        args.epochs = min(args.epochs, 2)
    (X, y, X_test, y_test), side = models.load_data_or_exit(
        args.seed, train_size=400 if args.quick else None)
    start = time.perf_counter()
    runs = {"ghost": dict(batch_norm="ghost", running_stats="each"),
            "ghost-pooled": dict(batch_norm="ghost", running_stats="pooled"),
            "exact": dict(batch_norm="exact")}
    trainers, evaluators, params = {}, {}, {}
    for name, options in runs.items():
        x, t, ps, loss, (test_loss, test_acc) = build(side, args.seed, name)
        trainers[name] = compile_accumulation(
            [x, t], loss, ps, lasagne_accum.momentum, dict(learning_rate=args.lr, momentum=0.9),
            every=args.accumulate, weight=x.shape[0], mode=args.mode, **options)
        evaluators[name] = pytensor.function([x, t], [test_loss, test_acc],
                                             mode=lasagne_accum.mode(args.mode or "CVM"))
        params[name] = ps
    print(f"digits CNN with 2 batch-norm layers, {len(X)} training examples, micro-batches "
          f"of {args.batch_size} x {args.accumulate}, momentum SGD lr={args.lr}")
    print(f"{'epoch':>5}  " + "  ".join(f"{n + ' loss/acc':>22}" for n in runs))
    rows = []
    for epoch in range(1, args.epochs + 1):
        rng = np.random.default_rng(args.seed + epoch)
        batches = list(models.minibatches(X, y, args.batch_size, rng))
        for name, trainer in trainers.items():
            for batch in batches:
                trainer.step(*batch)
            trainer.flush()
        row = {name: tuple(float(v) for v in evaluators[name](X_test, y_test))
               for name in runs}
        rows.append(row)
        print(f"{epoch:5d}  " + "  ".join(f"{row[n][0]:13.4f} {100 * row[n][1]:7.2f}%"
                                          for n in runs))
    gap = max(float(np.max(np.abs(a.get_value() - b.get_value())))
              for a, b in zip(params["ghost"], params["exact"]))
    print(f"largest |ghost - exact| parameter difference after training: {gap:.3g}")
    print(f"done in {time.perf_counter() - start:.1f} s (compiling included)")
    return {"rows": rows, "gap": gap, "trainers": trainers}


if __name__ == "__main__":
    main()
