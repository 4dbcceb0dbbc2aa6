#!/usr/bin/env python
"""Train a small MLP on scikit-learn's bundled handwritten digits.

Gradients of ``--accumulate`` mini-batches of ``--batch-size`` examples are
accumulated before each optimizer step (the two-function form of
lasagne_accum), so the effective batch is their product. Prints the training
loss per epoch and the test loss and accuracy at the end.

    python examples/mlp_digits.py --epochs 10 --batch-size 16 --accumulate 4
"""

import time

import numpy as np
import pytensor

import lasagne_accum
from lasagne_accum import compile_accumulation, run_epoch

import models


def parse_args(argv=None):
    p = models.parser(__doc__)
    models.add_flags(p, epochs=10)
    p.add_argument("--batch-size", type=models.positive_int, default=16,
                   help="examples per mini-batch (one call of the accumulate function)")
    p.add_argument("--accumulate", type=models.positive_int, default=4, metavar="N",
                   help="mini-batches per optimizer step")
    models.add_flags(p, optimizer="adam", lr=3e-3)
    p.add_argument("--hidden", type=models.positive_int, default=64,
                   help="hidden units of the MLP")
    models.add_flags(p, mode=(None, "PyTensor mode for both functions (NUMBA, CVM, JAX); "
                                    "default: lasagne_accum.default_modes(), the faster of C "
                                    "and Numba for each step on this machine"),
                     seed=0, no_progress=False)
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    (X_train, y_train, X_test, y_test), _ = models.load_data_or_exit(args.seed)
    start = time.perf_counter()          # the time reported includes compiling
    model = models.build_mlp(X_train.shape[1], args.hidden, 10, args.seed)
    x = model.x
    modes = models.mode_names(args.mode)
    with models.compiling(f"the accumulate ({modes[0]}) and apply ({modes[1]}) functions"):
        trainer = compile_accumulation(
            [x, model.y], model.loss, model.params, models.rule(args.optimizer),
            dict(learning_rate=args.lr), every=args.accumulate, weight=x.shape[0],
            mode=args.mode,
            # JIT backends (Numba, JAX, PyTorch) compile on the first call: warm up here,
            # so that the time printed for compiling is all of it
            example=(X_train[:args.batch_size], y_train[:args.batch_size]),
        )
        evaluate = pytensor.function([x, model.y], [model.loss, model.accuracy],
                                     mode=lasagne_accum.mode(modes[0]))
    print(f"lasagne_accum {lasagne_accum.__version__}, pytensor {pytensor.__version__}; "
          f"modes: accumulate={modes[0]}, apply={modes[1]}")
    print(f"digits: {len(X_train)} train / {len(X_test)} test; {args.optimizer} lr={args.lr}, "
          f"batch {args.batch_size} x accumulate {args.accumulate} = effective batch "
          f"{args.batch_size * args.accumulate}")
    rng = np.random.RandomState(args.seed)
    for epoch in range(1, args.epochs + 1):
        batches = models.minibatches(X_train, y_train, args.batch_size, rng)
        train_loss = run_epoch(trainer, batches, progress=not args.no_progress,
                               desc=f"epoch {epoch}")
        test_loss, test_acc = evaluate(X_test, y_test)
        print(f"epoch {epoch:3d}  train loss {train_loss:.4f}  test loss {float(test_loss):.4f}"
              f"  test accuracy {100 * float(test_acc):.2f}%  ({trainer.steps} steps)")
    print(f"done in {time.perf_counter() - start:.1f} s (compiling included)")
    return float(test_loss), float(test_acc)


if __name__ == "__main__":
    main()
