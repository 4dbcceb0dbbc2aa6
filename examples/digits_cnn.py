#!/usr/bin/env python
"""Lasagne's mnist.py, on PyTensor: a small CNN (or an MLP) with lasagne_accum's rules.

The model is built from PyTensor ops only (see ``examples/models.py``): a 3x3
convolution written as im2col (shifted slices stacked into patches) and one
matrix product, ReLU, 2x2 max-pooling by reshape and ``max``, a dense ReLU
layer and a softmax output. Three ways to train, all from this library:

* plain: one function, one optimizer step per mini-batch;
* ``--accumulate N``: the two-function form (:func:`compile_accumulation`):
  one function accumulates each mini-batch's gradient, another applies the
  rule every N batches; the effective batch is N x ``--batch-size``;
* ``--average N``: the single-function form, ``rule(loss, params, lr,
  average=N)``: one function that steps on every N-th call.

``--model-average`` keeps a windowed average of the parameters
(:class:`lasagne_accum.ModelAverage`) and reports the test accuracy with it
too. Data: scikit-learn's bundled 8x8 digits (offline), or ``--mnist DIR``
with the four MNIST IDX files (``train-images-idx3-ubyte`` etc., optionally
``.gz``).

    python examples/digits_cnn.py --batch-size 5 --average 4 --model-average
    python examples/digits_cnn.py --mnist ~/data/mnist --epochs 2 --accumulate 10
"""

import time

import numpy as np
import pytensor

import lasagne_accum
from lasagne_accum import ModelAverage
from lasagne_accum import compile_accumulation, default_modes, run_epoch

import models


def parse_args(argv=None):
    p = models.parser(__doc__)
    models.add_flags(p, model="cnn")
    p.add_argument("--batch-size", type=models.positive_int, default=16,
                   help="examples per mini-batch (one call of the training function)")
    models.add_flags(p, optimizer=("nesterov_momentum", "update rule, as in mnist.py"),
                     lr=0.02, momentum=0.9)
    form = p.add_mutually_exclusive_group()
    form.add_argument("--accumulate", type=models.positive_int, default=1, metavar="N",
                      help="two-function form: apply every N mini-batches")
    form.add_argument("--average", type=models.positive_int, default=1, metavar="N",
                      help="single-function form: rule(..., average=N)")
    p.add_argument("--model-average", action="store_true",
                   help="also evaluate a ModelAverage of the parameters")
    models.add_flags(p, epochs=10)
    p.add_argument("--mnist", metavar="DIR", default=None,
                   help="read MNIST IDX files from DIR instead of the bundled digits")
    models.add_flags(p, train_size=None, mode=None, seed=0, no_progress=False)
    return p.parse_args(argv)


def build_trainer(model, args, steps_per_epoch):
    """Compile the training function(s); returns (train_epoch, model_average or None)."""
    rule = models.rule(args.optimizer)
    hyper = models.rule_kwargs(args.optimizer, args.lr, args.momentum)
    x, y, params = model.x, model.y, model.params
    window = dict(average_window_rate=0.15, min_average_window=max(1, steps_per_epoch // 5),
                  max_average_window=max(1, steps_per_epoch))

    if args.accumulate > 1:
        # Two functions: compile_accumulation builds the average on its apply step
        # (the parameters after each optimizer step) and hands it back.
        trainer = compile_accumulation(
            [x, y], model.loss, params, rule, hyper, every=args.accumulate,
            weight=x.shape[0], model_average=window if args.model_average else None,
            mode=args.mode,
        )
        average = trainer.model_average

        def train_epoch(batches, desc):
            return run_epoch(trainer, batches, progress=not args.no_progress, desc=desc)

        return train_epoch, average

    # One function; with average=N it steps on every N-th call, and the model
    # average (gated by the dictionary's .is_step) counts optimizer steps only.
    updates = rule(model.loss, params, average=args.average,
                   weight=x.shape[0] if args.average > 1 else None, **hyper)
    average = ModelAverage(params, updates=updates, **window) if args.model_average else None
    if average:
        updates.update(average.updates)
    train_fn = pytensor.function([x, y], model.loss, updates=updates,
                                 mode=lasagne_accum.mode(args.mode or default_modes()[0]))

    def train_epoch(batches, desc):
        bar = models.progress(batches, desc=desc, enabled=not args.no_progress)
        losses = []
        for xb, yb in bar:
            losses.append(float(train_fn(xb, yb)))
            bar.set(f"loss {losses[-1]:.4f}")
        return float(np.mean(losses))

    return train_epoch, average


def main(argv=None):
    args = parse_args(argv)
    (X_train, y_train, X_test, y_test), side = models.load_data_or_exit(
        args.seed, args.train_size, args.mnist)

    start = time.perf_counter()
    model = models.build_model(args.model, side, seed=args.seed)
    n_batches = -(-len(X_train) // args.batch_size)
    every = max(args.accumulate, args.average)
    train_epoch, average = build_trainer(model, args, -(-n_batches // every))
    evaluate = model.evaluator(args.mode or default_modes()[0])

    form = (f"accumulate {args.accumulate} (two functions)" if args.accumulate > 1 else
            f"average={args.average} (one function)" if args.average > 1 else "plain")
    print(f"lasagne_accum {lasagne_accum.__version__}, pytensor {pytensor.__version__}; "
          f"{args.model.upper()} on {len(X_train)} train / {len(X_test)} test images "
          f"({side}x{side}); {args.optimizer} lr={args.lr:g}, batch {args.batch_size}, "
          f"{form}, effective batch {args.batch_size * every}", flush=True)
    rng = np.random.RandomState(args.seed)
    history = []
    for epoch in range(1, args.epochs + 1):
        batches = models.minibatches(X_train, y_train, args.batch_size, rng)
        train_loss = train_epoch(batches, f"epoch {epoch}")
        test_loss, test_acc = evaluate(X_test, y_test)
        history.append((train_loss, test_loss, test_acc))
        print(f"epoch {epoch:3d}  train loss {train_loss:.4f}  test loss {test_loss:.4f}  "
              f"test accuracy {100 * test_acc:.2f}%", flush=True)
    result = dict(history=history, test_loss=test_loss, test_acc=test_acc)
    if average is not None and int(models.value(average.num_updates)) == 0:
        print("with ModelAverage: no optimizer step taken yet, nothing averaged")
    elif average is not None:
        with average.apply():
            result["avg_test_loss"], result["avg_test_acc"] = evaluate(X_test, y_test)
        print(f"with ModelAverage: test loss {result['avg_test_loss']:.4f}  "
              f"test accuracy {100 * result['avg_test_acc']:.2f}%")
    print(f"done in {time.perf_counter() - start:.1f} s (compiling included)")
    return result


if __name__ == "__main__":
    main()
