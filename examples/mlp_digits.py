#!/usr/bin/env python
"""Train a small MLP on scikit-learn's bundled handwritten digits.

Gradients of ``--accumulate`` mini-batches of ``--batch-size`` examples are
accumulated before each optimizer step (the two-function form of
lasagne_accum), so the effective batch is their product. Prints the training
loss per epoch and the test loss and accuracy at the end.

    python examples/mlp_digits.py --epochs 10 --batch-size 16 --accumulate 4
"""

import argparse
import sys
import time

import numpy as np
import pytensor
import pytensor.tensor as pt

import lasagne_accum
from lasagne_accum import updates as rules
from lasagne_accum.training import compile_accumulation, default_modes, run_epoch

OPTIMIZERS = ["sgd", "momentum", "nesterov_momentum", "adagrad", "rmsprop", "adadelta",
              "adam", "adamax", "amsgrad"]


def load_digits(seed, test_fraction=0.25, dtype="float32"):
    """The 1797 8x8 digit images bundled with scikit-learn, scaled to [0, 1]."""
    try:
        from sklearn.datasets import load_digits as sk_load_digits
    except ImportError:
        sys.exit("error: this example needs scikit-learn: pip install -e '.[examples]'")
    data = sk_load_digits()
    X = (data.data / 16.0).astype(dtype)
    y = data.target.astype("int64")
    order = np.random.RandomState(seed).permutation(len(X))
    n_test = int(len(X) * test_fraction)
    test, train = order[:n_test], order[n_test:]
    return X[train], y[train], X[test], y[test]


def build_mlp(n_in, n_hidden, n_out, seed, dtype="float32"):
    """Symbolic inputs, a ReLU MLP's params, its mean cross-entropy and accuracy."""
    rng = np.random.RandomState(seed)

    def glorot(shape, name):
        bound = np.sqrt(6.0 / sum(shape))
        return pytensor.shared(rng.uniform(-bound, bound, shape).astype(dtype), name=name)

    W1, W2 = glorot((n_in, n_hidden), "W1"), glorot((n_hidden, n_out), "W2")
    b1 = pytensor.shared(np.zeros(n_hidden, dtype), name="b1")
    b2 = pytensor.shared(np.zeros(n_out, dtype), name="b2")
    x, y = pt.matrix("x", dtype=dtype), pt.vector("y", dtype="int64")
    hidden = pt.maximum(x @ W1 + b1, 0)
    logits = hidden @ W2 + b2
    log_probs = logits - pt.logsumexp(logits, axis=1, keepdims=True)
    loss = -log_probs[pt.arange(y.shape[0]), y].mean()
    accuracy = pt.eq(pt.argmax(logits, axis=1), y).mean()
    return x, y, [W1, b1, W2, b2], loss, accuracy


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--accumulate", type=int, default=4, metavar="N",
                   help="mini-batches per optimizer step (default 4)")
    p.add_argument("--optimizer", default="adam", choices=OPTIMIZERS)
    p.add_argument("--lr", type=float, default=3e-3, help="learning rate (default 3e-3)")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--mode", default=None,
                   help="PyTensor mode for both functions (NUMBA, CVM, JAX); default: "
                        "C for accumulation, Numba for the apply step")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    for name in ("epochs", "batch_size", "accumulate", "hidden"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.lr <= 0:
        p.error("--lr must be > 0")
    return args


def main(argv=None):
    args = parse_args(argv)
    X_train, y_train, X_test, y_test = load_digits(args.seed)
    x, y, params, loss, accuracy = build_mlp(X_train.shape[1], args.hidden, 10, args.seed)
    rule = getattr(rules, args.optimizer)
    trainer = compile_accumulation(
        [x, y], loss, params, rule, dict(learning_rate=args.lr), every=args.accumulate,
        weight=x.shape[0], mode=args.mode,
    )
    evaluate = pytensor.function([x, y], [loss, accuracy], mode=args.mode)
    modes = (args.mode, args.mode) if args.mode else default_modes()
    print(f"lasagne_accum {lasagne_accum.__version__}, pytensor {pytensor.__version__}; "
          f"modes: accumulate={modes[0]}, apply={modes[1]}")
    print(f"digits: {len(X_train)} train / {len(X_test)} test; {args.optimizer} lr={args.lr}, "
          f"batch {args.batch_size} x accumulate {args.accumulate} = effective batch "
          f"{args.batch_size * args.accumulate}")
    rng = np.random.RandomState(args.seed)
    start = time.perf_counter()
    for epoch in range(1, args.epochs + 1):
        order = rng.permutation(len(X_train))
        batches = [(X_train[order[i:i + args.batch_size]], y_train[order[i:i + args.batch_size]])
                   for i in range(0, len(order), args.batch_size)]
        train_loss = run_epoch(trainer, batches, progress=not args.no_progress,
                               desc=f"epoch {epoch}")
        test_loss, test_acc = evaluate(X_test, y_test)
        print(f"epoch {epoch:3d}  train loss {train_loss:.4f}  test loss {float(test_loss):.4f}"
              f"  test accuracy {100 * float(test_acc):.2f}%  ({trainer.steps} steps)")
    print(f"done in {time.perf_counter() - start:.1f} s")
    return float(test_loss), float(test_acc)


if __name__ == "__main__":
    main()
