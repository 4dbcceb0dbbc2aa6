#!/usr/bin/env python
"""Train a small MLP on scikit-learn's digits with a parameter server.

The same code runs on both backends: ``--backend local`` (threads in this
process) or ``--backend dask`` (a loopback Dask LocalCluster of processes, or
the scheduler at ``--address``). ``--mode sync`` merges every worker's
gradient into one step per round (the large-batch step); ``--mode async``
applies each push on arrival.

    python examples/distributed_digits.py --backend local --mode sync --workers 2
    python examples/distributed_digits.py --backend dask --mode async --workers 2 --accumulate 4
"""

import functools
import time
from collections import Counter

import numpy as np
import pytensor
import pytensor.tensor as pt

import lasagne_accum
from lasagne_accum import updates as rules
from lasagne_accum.distributed import DaskOptions, train

import models

OPTIMIZERS = ["sgd", "momentum", "nesterov_momentum", "adagrad", "rmsprop", "adam", "adamax",
              "amsgrad"]


def mlp(hidden=64, seed=0):
    """A 64-hidden-10 ReLU MLP: inputs, params, mean cross-entropy and logits."""
    rng = np.random.RandomState(seed)

    def glorot(shape, name):
        bound = np.sqrt(6.0 / sum(shape))
        return pytensor.shared(rng.uniform(-bound, bound, shape).astype("float32"), name=name)

    W1, W2 = glorot((64, hidden), "W1"), glorot((hidden, 10), "W2")
    b1 = pytensor.shared(np.zeros(hidden, "float32"), name="b1")
    b2 = pytensor.shared(np.zeros(10, "float32"), name="b2")
    x, y = pt.matrix("x", dtype="float32"), pt.vector("y", dtype="int64")
    logits = pt.maximum(x @ W1 + b1, 0) @ W2 + b2
    log_probs = logits - pt.logsumexp(logits, axis=1, keepdims=True)
    loss = -log_probs[pt.arange(y.shape[0]), y].mean()
    return [x, y], [W1, b1, W2, b2], loss, logits


def build_model(hidden=64, seed=0):
    """What every worker builds: (inputs, loss, params). Module level, so Dask can ship it."""
    inputs, params, loss, _ = mlp(hidden, seed)
    return inputs, loss, params


def worker_batches(X, y, workers, batch_size, epochs, seed):
    """Worker k gets examples k, k+K, ...; shuffled batches, `epochs` passes."""
    rng = np.random.RandomState(seed)
    out = []
    for k in range(workers):
        Xk, yk = X[k::workers], y[k::workers]
        batches = []
        for _ in range(epochs):
            order = rng.permutation(len(Xk))
            batches += [(Xk[order[i:i + batch_size]], yk[order[i:i + batch_size]])
                        for i in range(0, len(order), batch_size)]
        out.append(batches)
    return out


def parse_args(argv=None):
    p = models.parser(__doc__)
    p.add_argument("--backend", choices=["local", "dask"], default="local",
                   help="threads in this process, or a Dask cluster")
    p.add_argument("--mode", choices=["sync", "async"], default="sync",
                   help="sync: one merged step per round; async: each push applied on arrival")
    p.add_argument("--workers", type=models.positive_int, default=2, help="training workers")
    p.add_argument("--accumulate", type=models.positive_int, default=1, metavar="N",
                   help="batches accumulated locally per push")
    models.add_flags(p, epochs=10)
    p.add_argument("--batch-size", type=models.positive_int, default=32,
                   help="examples per mini-batch")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="adam", help="update rule")
    models.add_flags(p, lr=3e-3)
    p.add_argument("--decay", type=float, default=0.0,
                   help="learning rate lr / (1 + decay * step), with each shard's step")
    p.add_argument("--staleness-scale", action="store_true",
                   help="async: divide each step by its staleness")
    p.add_argument("--hidden", type=models.positive_int, default=64,
                   help="hidden units of the MLP")
    p.add_argument("--address", default=None,
                   help="dask: scheduler address (default: start a loopback LocalCluster)")
    p.add_argument("--shard-processes", type=int, default=1, metavar="N",
                   help="dask: processes that hold the shards and run no trainer (0: the "
                        "shards beside the trainers)")
    p.add_argument("--tls", action="store_true",
                   help="dask LocalCluster with a temporary TLS certificate "
                        "(needs the cryptography package)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the initial parameters, the split and the batches")
    args = p.parse_args(argv)
    if args.decay < 0:
        p.error("--decay must be >= 0")
    if args.staleness_scale and args.mode != "async":
        p.error("--staleness-scale applies to --mode async")
    if (args.address or args.tls) and args.backend != "dask":
        p.error("--address and --tls apply to --backend dask")
    if args.shard_processes < 0:
        p.error("--shard-processes must be >= 0")
    return args


def main(argv=None):
    args = parse_args(argv)
    (X, y, X_test, y_test), _ = models.load_data_or_exit(args.seed)
    data = worker_batches(X, y, args.workers, args.batch_size, args.epochs, args.seed)
    lr, decay = args.lr, args.decay
    rule_kwargs = {"learning_rate": (lambda step: lr / (1.0 + decay * step)) if decay else lr}
    security = None
    if args.tls:
        from distributed.security import Security
        security = Security.temporary()
    print(f"digits: {len(X)} train / {len(X_test)} test; {args.workers} workers "
          f"({args.backend}, {args.mode}), {args.optimizer} lr={lr}, batch {args.batch_size} "
          f"x accumulate {args.accumulate}, {args.epochs} epochs")
    start = time.perf_counter()
    result = train(functools.partial(build_model, hidden=args.hidden), data,
                   getattr(rules, args.optimizer), rule_kwargs,
                   mode=args.mode, backend=args.backend, accumulate=args.accumulate,
                   staleness_scale=args.staleness_scale,
                   dask=DaskOptions(address=args.address, security=security,
                                    shard_processes=args.shard_processes))
    total = time.perf_counter() - start

    (x, yv), params, loss, logits = mlp(args.hidden)
    for p in params:
        p.set_value(result.params[p.name])
    evaluate = pytensor.function([x, yv], [loss, pt.eq(pt.argmax(logits, axis=1), yv).mean()],
                                 mode=lasagne_accum.mode(lasagne_accum.default_modes()[0]))
    per_epoch = len(data[0]) // args.epochs
    print("epoch  mean batch loss (all workers)")
    for e in range(args.epochs):
        losses = [l for r in result.workers
                  for _, l, _ in r["losses"][e * per_epoch:(e + 1) * per_epoch]]
        print(f"{e + 1:5d}  {np.mean(losses):.4f}")
    train_loss, _ = evaluate(X, y)
    test_loss, test_acc = evaluate(X_test, y_test)
    print(f"train loss {float(train_loss):.4f}, test loss {float(test_loss):.4f}, "
          f"test accuracy {float(test_acc):.3f}")
    print(f"{result.pushes} pushes ({result.pushes_per_second:.0f}/s), optimizer steps "
          f"{result.version[0]}, {result.bytes_per_example:.0f} gradient bytes/example")
    if args.mode == "async":
        seen = Counter(s for r in result.workers for s in r["staleness"])
        print(f"staleness per push (largest over the shards): {dict(sorted(seen.items()))}")
    print(f"training {result.elapsed:.1f} s, total with start-up and compiling {total:.1f} s")


if __name__ == "__main__":
    main()
