#!/usr/bin/env python
"""Which micro-batch fits: the B and N of an effective batch on a memory budget.

:func:`lasagne_accum.memory_plan` compiles the two training functions of the
model (accumulate a micro-batch's gradient; apply the rule) for JAX and asks
XLA how many bytes a call takes for a micro-batch of B examples: the
parameters, the rule's state and the gradient buffers, resident for the whole
run, and the batch, activations and temporaries of one step. It prints the
largest B (a divisor of the effective batch) that fits the budget and the
number N of micro-batches per optimizer step, then trains ``--windows``
optimizer steps of N x B examples with that plan (in ``--mode``, JAX by
default) and prints the loss.

The plan is XLA's for the device JAX compiles for (the CPU here, a GPU where
JAX has one); ``tests/test_memory.py`` checks it against the measured peak on
the CPU.

    python examples/memory_plan.py --model mlp --hidden 4096 --budget 50
"""

import time

import numpy as np

import lasagne_accum
from lasagne_accum.memory import MB

import models


def parse_args(argv=None):
    p = models.parser(__doc__)
    models.add_flags(p, model="mlp")
    p.add_argument("--hidden", type=models.positive_int, default=4096,
                   help="hidden units of the MLP (and of the CNN's dense layer)")
    p.add_argument("--effective-batch", type=models.positive_int, default=4096,
                   help="examples per optimizer step, N*B")
    p.add_argument("--budget", type=models.positive_float, default=50.0,
                   help="device memory for training, in MB (10**6 bytes)")
    models.add_flags(p, optimizer="adam", lr=1e-3)
    p.add_argument("--windows", type=int, default=1,
                   help="optimizer steps to train with the plan (0: plan only)")
    models.add_flags(p, mode=("JAX", "PyTensor mode of the training functions (JAX, "
                                     "PYTORCH, CVM, NUMBA...); the plan itself is XLA's"),
                     seed=0)
    args = p.parse_args(argv)
    if args.windows < 0:
        p.error(f"--windows must be >= 0, got {args.windows}")
    return args


def main(argv=None):
    args = parse_args(argv)
    (X, y, _, _), side = models.load_data_or_exit(args.seed)
    model = models.build_model(args.model, side, seed=args.seed, n_hidden=args.hidden)
    rule = models.rule(args.optimizer)
    hyper = models.rule_kwargs(args.optimizer, args.lr)
    print(f"{args.model.upper()} ({args.hidden} hidden units) on {side}x{side} digits, "
          f"{args.optimizer}", flush=True)
    start = time.perf_counter()
    try:
        plan = lasagne_accum.memory_plan(
            ([model.x, model.y], model.loss), model.params, args.effective_batch,
            args.budget * MB, example=(X[:1], y[:1]), update_rule=rule, rule_kwargs=hyper)
    except ValueError as exc:   # a budget below one example: says which budget fits
        models.fail(str(exc))
    print(f"effective batch {plan.effective_batch} on a budget of {args.budget:g} MB: "
          f"B={plan.batch_size}, N={plan.accumulate}")
    print(f"  resident: {plan.state / MB:.2f} MB (parameters, {args.optimizer} state, "
          f"gradient buffers); accumulate step: +{plan.accumulate_step.transient / MB:.2f} "
          f"MB; apply step: +{plan.apply_step.transient / MB:.2f} MB; peak "
          f"{plan.peak / MB:.2f} MB ({time.perf_counter() - start:.1f} s to plan)")
    losses = []
    if args.windows:
        trainer = lasagne_accum.compile_accumulation(
            [model.x, model.y], model.loss, model.params, rule, hyper,
            every=plan.accumulate, mode=args.mode)
        order = np.random.RandomState(args.seed)
        B = plan.batch_size
        for window in range(args.windows):
            # N micro-batches of B examples, drawn with replacement from the digits
            index = order.randint(0, len(X), size=plan.effective_batch)
            loss = np.mean([float(trainer.step(X[index[k:k + B]], y[index[k:k + B]]))
                            for k in range(0, plan.effective_batch, B)])
            losses.append(float(loss))
            print(f"optimizer step {window + 1}: mean loss {loss:.4f} over "
                  f"{plan.accumulate} x {B} examples", flush=True)
    print(f"done in {time.perf_counter() - start:.1f} s (compiling included)")
    return dict(batch_size=plan.batch_size, accumulate=plan.accumulate, peak=plan.peak,
                state=plan.state, losses=losses, plan=plan)


if __name__ == "__main__":
    main()
