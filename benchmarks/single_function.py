#!/usr/bin/env python
"""Single-function accumulation (``average=N``) against the two-function form.

For each installed backend, on the 784-512-10 MLP (batch 64, Adam, N=4):

* ``acc``: the two-function form's accumulate step, ``apply``: its apply step;
* ``non-step``: a call of the single function that does not step (calls 1..N-1
  of a window), ``step``: the N-th call;
* ratios ``non-step / acc`` and ``step / (acc + apply)`` (targets: <= 1.05).

Three graph choices are compared: ``lazy`` (the default: the rule behind
``ifelse``, which the library turns into its ``LazyStep`` op in C and Numba:
the rule runs in place on stepping calls only), ``ifelse`` (the same graph
compiled without that rewrite: PyTensor's own ``IfElse``), ``switch`` (the
rule computed every call and selected) and ``select``: ``lazy`` without the
rewrite that folds the buffer's lazy reset, ``select(fresh, 0, acc) + dot``,
into the ``Gemm``'s beta (the select then costs a buffer-sized pass per call).
Each window of N calls of each variant is timed call by call; the variants
alternate within every round; the table shows medians. Each backend runs in
its own process (one after the other).

    python benchmarks/single_function.py [--dtype float32] [--rounds 60] [--modes CVM NUMBA]
    python benchmarks/single_function.py --quick     # smoke test: C and Numba, 6 rounds
"""

import argparse
import os
import subprocess
import sys
import time

import pytensor
from pytensor.compile.mode import get_mode

from common import available_modes, batch, load_average, median, mlp

from lasagne_accum import accumulate_gradients, adam, with_accumulated_gradients

VARIANTS = ("lazy", "select", "ifelse", "switch")


def build(mode, dtype, every):
    out = {}
    (x, y), params, loss = mlp(dtype)
    acc = accumulate_gradients(loss, params)
    apply = adam(acc.grads, params, 1e-3)
    apply.update(acc.reset)
    out["acc"] = pytensor.function([x, y], loss, updates=acc.accumulate, mode=mode)
    out["apply"] = pytensor.function([], [], updates=apply, mode=mode)
    # "ifelse": the lazy form as PyTensor compiles it without the library's LazyStep rewrite
    plain = get_mode(mode).excluding("lasagne_accum_lazy_step_c", "lasagne_accum_lazy_step_numba")
    select = get_mode(mode).excluding("lasagne_accum_gemm_reset")
    for variant, lazy, m in (("lazy", True, mode), ("select", True, select),
                             ("ifelse", True, plain), ("switch", False, mode)):
        (x, y), params, loss = mlp(dtype)
        upd = with_accumulated_gradients(loss, params, every, adam, lazy=lazy, learning_rate=1e-3)
        out[variant] = pytensor.function([x, y], loss, updates=upd, mode=m)
    return out


def measure(fns, data, every, rounds):
    """Per-call times, and the ratios of each call to its neighbouring baseline call.

    Every call of a window goes baseline first (accumulate, plus apply on the
    last call), then each variant at the same position of its own window, in
    an order rotating per round: a load burst hits neighbours alike.
    """
    t = {k: [] for k in ("acc", "apply", *(f"{v}-{c}" for v in VARIANTS
                                             for c in ("non-step", "step")))}
    ratio = {f"{v}-{c}": [] for v in VARIANTS for c in ("non-step", "step")}
    clock = time.perf_counter
    for r in range(rounds):
        order = VARIANTS[r % len(VARIANTS):] + VARIANTS[:r % len(VARIANTS)]
        for c in range(every):
            s = clock(); fns["acc"](*data); a = clock() - s
            t["acc"].append(a)
            base = a
            if c == every - 1:
                s = clock(); fns["apply"](); p = clock() - s
                t["apply"].append(p)
                base = a + p
            kind = "step" if c == every - 1 else "non-step"
            for variant in order:
                s = clock(); fns[variant](*data); d = clock() - s
                t[f"{variant}-{kind}"].append(d)
                ratio[f"{variant}-{kind}"].append(d / base)
    out = {k: median(v) for k, v in t.items()}
    out.update({f"ratio {k}": median(v) for k, v in ratio.items()})
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    p.add_argument("--every", type=int, default=4)
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--modes", nargs="*", default=None)
    p.add_argument("--quick", action="store_true", help="C and Numba only, 6 rounds")
    args = p.parse_args()
    args.rounds = args.rounds or (6 if args.quick else 60)
    modes = args.modes or (["CVM", "NUMBA"] if args.quick else available_modes())
    if len(modes) > 1:
        # one process per backend: in a shared one, the C backend's OpenBLAS threads
        # still spin while the next Numba call runs (scipy's OpenBLAS), and the
        # other backend's buffers evict this one's from the cache between calls
        for mode in modes:
            cmd = [sys.executable, os.path.abspath(__file__), "--dtype", args.dtype,
                   "--every", str(args.every), "--rounds", str(args.rounds), "--modes", mode]
            out = subprocess.run(cmd, capture_output=True, text=True)
            lines = out.stdout.splitlines()
            if out.returncode:
                raise SystemExit(f"{mode}: exit {out.returncode}\n{out.stderr[-3000:]}")
            print("\n".join(lines))
        return
    print(load_average())
    data = batch(args.dtype)
    print(f"pytensor {pytensor.__version__}, blas: {pytensor.config.blas__ldflags or 'none'}; "
          f"784-512-10 MLP, batch 64, adam, N={args.every}, {args.dtype}, {args.rounds} rounds")
    built = {}
    for mode in modes:
        try:
            built[mode] = build(mode, args.dtype, args.every)
            measure(built[mode], data, args.every, 3)  # warm-up (JIT compilation)
        except Exception as exc:  # a backend that cannot compile this graph
            print(f"{mode}: skipped ({type(exc).__name__}: {str(exc).splitlines()[0][:80]})")
    results = {m: {} for m in built}
    for _ in range(3):  # interleave the backends too
        for mode, fns in built.items():
            r = measure(fns, data, args.every, max(1, args.rounds // 3))
            for k, v in r.items():
                results[mode].setdefault(k, []).append(v)
    header = (f"{'backend':8} {'acc ms':>7} {'apply ms':>8} {'variant':>7} {'non-step':>9}"
              f" {'step':>7} {'non-step/acc':>13} {'step/(acc+apply)':>17}")
    print(header)
    print("-" * len(header))
    for mode, r in results.items():
        rr = {k: median(v) for k, v in r.items()}
        r = {k: median(v) * 1e3 for k, v in r.items()}
        for variant in VARIANTS:
            ns, st = r[f"{variant}-non-step"], r[f"{variant}-step"]
            print(f"{mode:8} {r['acc']:7.3f} {r['apply']:8.3f} {variant:>7} {ns:9.3f} {st:7.3f}"
                  f" {rr[f'ratio {variant}-non-step']:13.3f}"
                  f" {rr[f'ratio {variant}-step']:17.3f}")
    print("(ms: medians per call; ratios: medians of each call over its neighbouring "
          "baseline call(s); targets <= 1.05)")
    print(load_average())


if __name__ == "__main__":
    main()
