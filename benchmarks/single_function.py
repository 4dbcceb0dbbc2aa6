#!/usr/bin/env python
"""Single-function accumulation (``average=N``) against the two-function form.

For each installed backend, on the 784-512-10 MLP (batch 64, Adam, N=4):

* ``acc``: the two-function form's accumulate step, ``apply``: its apply step;
* ``non-step``: a call of the single function that does not step (calls 1..N-1
  of a window), ``step``: the N-th call;
* ratios ``non-step / acc`` and ``step / (acc + apply)`` (targets: <= 1.05).

Every function is compiled with ``lasagne_accum.mode(<backend>)``. Four graph
choices are compared: ``lazy`` (the default: the rule behind one lazy step,
which the library's mode compiles to its ``LazyStep`` op in C and Numba: the
rule runs in place on stepping calls only), ``ifelse`` (the same graph with
the rewrite ``lasagne_accum_lazy_step`` left out: PyTensor's own ``IfElse``),
``switch`` (the rule computed every call and selected) and ``select``:
``lazy`` without the rewrite that folds the buffer's reset,
``select(stale, 0, acc) + dot``, into the ``Gemm``'s beta (the select then
costs a buffer-sized pass per call).
A ``control`` row times a second, identical two-function pair the same way:
its ratios would be 1 without noise, so their distance from 1 is the
resolution of the method.

Every call is timed. At each call position of a window, the baseline, the
control and the variants run in a random order, and each call's time is
divided by the baseline's at the same position; the table shows medians.
Each backend runs in its own processes, one after the other, five times by
default: a process places its buffers anew and compiles the units in its own
random order, and each of these alone moves a call's time by a few per cent
(:func:`build`), so one process is one draw. The table gives the median over
the processes and their range.

    python benchmarks/single_function.py [--dtype float32] [--rounds 60] [--processes 5]
                                         [--modes CVM NUMBA]
    python benchmarks/single_function.py --quick     # smoke test: C and Numba, 6 rounds, 1 process
"""

import argparse
import json
import os
import subprocess
import sys
import time

import pytensor

from common import LR, PROTO, available_modes, batch, load_average, median, mlp

from lasagne_accum import accumulate_gradients, adam, mode as la_mode, \
    with_accumulated_gradients

VARIANTS = ("lazy", "select", "ifelse", "switch")


def two_function(mode, dtype):
    """The two-function form on its own parameters: (accumulate, apply with the reset)."""
    mode = la_mode(mode)
    (x, y), params, loss = mlp(dtype)
    acc = accumulate_gradients(loss, params)
    apply = adam(acc.grads, params, LR)
    apply.update(acc.reset)
    return (pytensor.function([x, y], loss, updates=acc.accumulate, mode=mode),
            pytensor.function([], [], updates=apply, mode=mode))


def build(mode, dtype, every, rng):
    """Compile every unit, in a random order.

    The order matters: where a unit's buffers land depends on what was built
    before it, and that moves its calls' times by a few per cent. A fixed
    order would favour whatever is built late, the variants included.
    """
    ours = la_mode(mode)
    plain = ours.excluding("lasagne_accum_lazy_step")
    select = ours.excluding("lasagne_accum_gemm_reset")
    # "ifelse": the lazy form as PyTensor compiles it without the library's LazyStep
    variants = {"lazy": (True, ours), "select": (True, select), "ifelse": (True, plain),
                "switch": (False, ours)}

    def single_function(variant):
        lazy, m = variants[variant]
        (x, y), params, loss = mlp(dtype)
        upd = with_accumulated_gradients(loss, params, every, adam, lazy=lazy, learning_rate=LR)
        return pytensor.function([x, y], loss, updates=upd, mode=m)

    out = {}
    for unit in rng.permutation(["base", "control", *variants]):
        # "control" is the baseline's identical twin
        out[unit] = (two_function(mode, dtype) if unit in ("base", "control")
                     else single_function(unit))
    return out


def measure(fns, data, every, rounds, rng):
    """Per-call times, and the ratios of each call to the baseline call at its position.

    A unit is the baseline (the two-function form: accumulate, plus apply on
    the last call of a window), its ``control`` (a second, identical
    two-function pair on its own parameters) or a variant. Each call position
    of every round runs all units in a random order: no unit always follows
    another, and a load burst hits them alike. The ``control`` row measures
    the method itself: identical work, so its ratios show the noise.
    """
    units = ("base", "control", *VARIANTS)
    kinds = ("non-step", "step")
    t = {k: [] for k in ("acc", "apply", *(f"{u}-{c}" for u in units[1:] for c in kinds))}
    ratio = {f"{u}-{c}": [] for u in units[1:] for c in kinds}
    clock = time.perf_counter
    for _ in range(rounds):
        for c in range(every):
            kind = "step" if c == every - 1 else "non-step"
            took = {}
            for unit in rng.permutation(units):
                if unit in VARIANTS:
                    s = clock(); fns[unit](*data); took[unit] = clock() - s
                    continue
                accumulate, apply = fns[unit]
                s = clock(); accumulate(*data); took[unit] = a = clock() - s
                if unit == "base":
                    t["acc"].append(a)
                if kind == "step":
                    s = clock(); apply(); p = clock() - s
                    took[unit] += p
                    if unit == "base":
                        t["apply"].append(p)
            for unit in units[1:]:
                t[f"{unit}-{kind}"].append(took[unit])
                ratio[f"{unit}-{kind}"].append(took[unit] / took["base"])
    out = {k: median(v) for k, v in t.items()}
    out.update({f"ratio {k}": median(v) for k, v in ratio.items()})
    return out


def run_one(mode, args):
    """Build and time one backend in this process: :func:`measure`'s dict.

    A backend that fails to compile or run these graphs fails the script: every
    mode measured is installed here (:func:`common.available_modes`), so a
    failure is a bug to see, not a row to leave out."""
    import numpy as np

    data = batch(args.dtype)
    rng = np.random.default_rng(args.seed)
    fns = build(mode, args.dtype, args.every, rng)
    measure(fns, data, args.every, 3, rng)  # warm-up (JIT compilation)
    return measure(fns, data, args.every, args.rounds, rng)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    p.add_argument("--every", type=int, default=4)
    p.add_argument("--rounds", type=int, default=None, help="rounds per process (default 60)")
    p.add_argument("--processes", type=int, default=None,
                   help="processes per backend (default 5): each lays out its buffers anew")
    p.add_argument("--modes", nargs="*", default=None)
    p.add_argument("--quick", action="store_true", help="C and Numba only, 6 rounds, 1 process")
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    args.rounds = args.rounds or (6 if args.quick else 60)
    args.processes = args.processes or (1 if args.quick else 5)
    modes = args.modes or (["CVM", "NUMBA"] if args.quick else available_modes())
    if args.child:
        print(PROTO + json.dumps(run_one(modes[0], args)))
        return
    print(load_average())
    print(f"pytensor {pytensor.__version__}, blas: {pytensor.config.blas__ldflags or 'none'}; "
          f"784-512-10 MLP, batch 64, adam, N={args.every}, {args.dtype}; per backend "
          f"{args.processes} process(es) x {args.rounds} rounds")
    # one process per backend and repeat: in a shared one, the C backend's OpenBLAS
    # threads still spin while the next Numba call runs (scipy's OpenBLAS), and the
    # other backend's buffers evict this one's from the cache between calls; and each
    # process places its buffers anew, which moves a call's time by a few per cent
    results = {m: [] for m in modes}
    for k in range(args.processes):
        for mode in modes:
            cmd = [sys.executable, os.path.abspath(__file__), "--child", "--dtype", args.dtype,
                   "--every", str(args.every), "--rounds", str(args.rounds), "--modes", mode,
                   "--seed", str(k)]
            out = subprocess.run(cmd, capture_output=True, text=True)
            lines = [ln for ln in out.stdout.splitlines() if ln.startswith(PROTO)]
            if out.returncode or not lines:
                raise SystemExit(f"{mode}: exit {out.returncode}\n{out.stderr[-3000:]}")
            results[mode].append(json.loads(lines[-1][len(PROTO):]))
    header = (f"{'backend':8} {'acc ms':>7} {'apply ms':>8} {'variant':>7} {'non-step':>9}"
              f" {'step':>7} {'non-step/acc':>19} {'step/(acc+apply)':>19}")
    print(header)
    print("-" * len(header))

    def cell(runs, key):  # median over processes, and their range
        values = [r[key] for r in runs]
        if len(values) == 1:
            return f"{values[0]:.3f}"
        return f"{median(values):.3f} [{min(values):.2f}-{max(values):.2f}]"

    for mode in modes:
        runs = results[mode]
        ms = {k: median([r[k] for r in runs]) * 1e3 for k in runs[0] if not k.startswith("ratio")}
        for variant in ("control", *VARIANTS):
            print(f"{mode:8} {ms['acc']:7.3f} {ms['apply']:8.3f} {variant:>7}"
                  f" {ms[f'{variant}-non-step']:9.3f} {ms[f'{variant}-step']:7.3f}"
                  f" {cell(runs, f'ratio {variant}-non-step'):>19}"
                  f" {cell(runs, f'ratio {variant}-step'):>19}")
    print("(ms: medians per call; ratios: medians of each call over the baseline call(s) at "
          "its position, then the median [range] over the processes; targets <= 1.05; "
          "'control' is the baseline's identical twin: its distance from 1 is the noise)")
    print(load_average())

if __name__ == "__main__":
    main()
