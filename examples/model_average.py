#!/usr/bin/env python
"""Test accuracy with and without parameter averaging (ModelAverage, EMA).

Trains the small CNN of ``digits_cnn.py`` on the bundled 8x8 digits with a
deliberately large learning rate, so that the last iterate is noisy, and
evaluates after every epoch three sets of parameters:

* ``raw``: the trained parameters;
* ``ModelAverage``: PaddlePaddle's windowed average (window: between a fifth
  of an epoch and one epoch of optimizer steps, see the class's Notes);
* ``EMA``: an exponential moving average with decay ``--ema-decay``.

Training uses the two-function form written out by hand (as in the README):
the averages' ``.updates`` are merged into the *apply* function, so that they
count optimizer steps, not mini-batches, and they get the rule's dictionary
(``updates=apply``) so that each step adds the freshly updated parameters.
``avg.apply()`` swaps the averages in for evaluation and puts the trained
values back afterwards, bit for bit.

    python examples/model_average.py --epochs 15 --lr 0.03
"""

import time

import numpy as np
import pytensor

from lasagne_accum import AccumulationTrainer, ExponentialMovingAverage, ModelAverage, \
    accumulate_gradients, mode

import models


def parse_args(argv=None):
    p = models.parser(__doc__)
    models.add_flags(p, model="cnn")
    p.add_argument("--batch-size", type=models.positive_int, default=8,
                   help="examples per mini-batch")
    p.add_argument("--accumulate", type=models.positive_int, default=2, metavar="N",
                   help="mini-batches per optimizer step")
    models.add_flags(p, optimizer="momentum",
                     lr=(0.05, "learning rate (large on purpose: a noisy last iterate)"),
                     momentum=0.9)
    p.add_argument("--ema-decay", type=models.unit_float, default=0.99,
                   help="decay of the ExponentialMovingAverage, in [0, 1)")
    models.add_flags(p, epochs=10, dtype="float64", train_size=None, mode=None, seed=0,
                     no_progress=False)
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    (X_train, y_train, X_test, y_test), side = models.load_data_or_exit(
        args.seed, args.train_size, dtype=args.dtype)
    start = time.perf_counter()
    model = models.build_model(args.model, side, seed=args.seed, dtype=args.dtype)
    x, params = model.x, model.params
    steps_per_epoch = -(-len(X_train) // (args.batch_size * args.accumulate))

    # The two-function form, by hand.
    accu, reset = accumulate_gradients(model.loss, params, weight=x.shape[0])
    rule = models.rule(args.optimizer)
    apply = rule(accu.grads, params, **models.rule_kwargs(args.optimizer, args.lr,
                                                          args.momentum))
    window = ModelAverage(params, average_window_rate=0.15,
                          min_average_window=max(1, steps_per_epoch // 5),
                          max_average_window=steps_per_epoch, updates=apply)
    ema = ExponentialMovingAverage(params, decay=args.ema_decay, updates=apply)
    apply.update(window.updates)
    apply.update(ema.updates)
    apply.update(reset)
    acc_mode, apply_mode = models.mode_names(args.mode)
    with models.compiling(f"the accumulate ({acc_mode}) and apply ({apply_mode}) functions"):
        step_fn = pytensor.function([model.x, model.y], model.loss, updates=accu,
                                    mode=mode(acc_mode))
        apply_fn = pytensor.function([], [], updates=apply, mode=mode(apply_mode))
        evaluate = model.evaluator(acc_mode)
        # JIT backends (Numba, JAX, PyTorch) compile on the first call: one call of each
        # here, every value put back after, so that the time printed is all the compiling
        AccumulationTrainer(step_fn, apply_fn, accu, args.accumulate, apply).warm_up(
            X_train[:args.batch_size], y_train[:args.batch_size])

    print(f"{args.model.upper()} on {len(X_train)} train / {len(X_test)} test digits; "
          f"{args.optimizer} lr={args.lr:g}, batch {args.batch_size} x accumulate "
          f"{args.accumulate}; ModelAverage window {window.min_average_window}.."
          f"{window.max_average_window} steps, EMA decay {args.ema_decay:g}", flush=True)
    print("epoch  raw acc %  ModelAverage acc %  EMA acc %   (test set)")
    rng = np.random.RandomState(args.seed)
    history = []
    for epoch in range(1, args.epochs + 1):
        batches = models.minibatches(X_train, y_train, args.batch_size, rng)
        bar = models.progress(batches, desc=f"epoch {epoch}", enabled=not args.no_progress)
        for i, (xb, yb) in enumerate(bar, 1):
            bar.set(f"loss {float(step_fn(xb, yb)):.4f}")
            if i % args.accumulate == 0 or i == len(batches):   # flush the epoch's tail
                apply_fn()
        row = {"raw": evaluate(X_test, y_test)}
        for name, average in (("ModelAverage", window), ("EMA", ema)):
            with average.apply():
                row[name] = evaluate(X_test, y_test)
        history.append(row)
        print(f"{epoch:5d}  {100 * row['raw'][1]:9.2f}  {100 * row['ModelAverage'][1]:18.2f}"
              f"  {100 * row['EMA'][1]:9.2f}", flush=True)

    final = history[-1]
    print("\nfinal test loss / accuracy:")
    for name, (loss, acc) in final.items():
        print(f"  {name:<13} {loss:.4f}  {100 * acc:.2f}%")
    for name in ("ModelAverage", "EMA"):
        ahead = sum(row[name][1] > row["raw"][1] for row in history)
        behind = sum(row[name][1] < row["raw"][1] for row in history)
        print(f"{name} ahead of raw after {ahead} of {len(history)} epochs, behind after "
              f"{behind}; mean test accuracy over epochs "
              f"{100 * np.mean([row[name][1] for row in history]):.2f}% vs raw "
              f"{100 * np.mean([row['raw'][1] for row in history]):.2f}%")
    print(f"done in {time.perf_counter() - start:.1f} s (compiling included)")
    return dict(history=history, final=final)


if __name__ == "__main__":
    main()
