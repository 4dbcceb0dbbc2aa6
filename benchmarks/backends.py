"""Which PyTensor backend should ``lasagne_accum`` use by default?

Measures, side by side in one run, the per-call time of the three kinds of
compiled functions the library produces, for the 784-512-10 ReLU MLP of
``common.mlp`` (mean cross-entropy, batch 64, ``common.batch``), in float32
and float64, built with the library itself:

1. ``fwd-bwd``    -- ``pytensor.function([x, y], grads)`` (gradients of the loss
                     w.r.t. W1, b1, W2, b2 returned as outputs);
2. ``accumulate`` -- ``pytensor.function([x, y], loss, updates=acc.accumulate)``
                     with ``acc = lasagne_accum.accumulate_gradients(loss, params)``;
3. ``adam apply`` -- ``pytensor.function([], [], updates=apply)`` with
                     ``apply = lasagne_accum.adam(acc.grads, params, 1e-3)``
                     (guarded) plus ``acc.reset``.

Functions 2 and 3 are ``lasagne_accum.compile_accumulation``'s own, given the
backend's mode (``common.trainer``): the graphs ``default_modes`` chooses for.

Backend configurations (each in its own, persistent, worker process):

* ``numba``    -- ``mode="NUMBA"`` (PyTensor 3's default);
* ``c-blas``   -- ``mode="CVM"`` (= ``Mode(linker="cvm", optimizer="fast_run")``)
                  with the auto-detected ``blas__ldflags``;
* ``c-noblas`` -- ``mode="CVM"`` with ``PYTENSOR_FLAGS=blas__ldflags=``.  Note:
                  PyTensor then has no C BLAS, so its Dot22/Gemm ops fall back
                  to their Python ``perform`` (``numpy.dot``, i.e. NumPy's own
                  bundled BLAS); the worker reports which nodes run without a
                  C thunk;
* ``jax``      -- ``mode="JAX"`` on the CPU (only if ``import jax`` works); the
  timings wait for JAX's asynchronous results (``block_until_ready``);
* ``torch``    -- optional PyTorch float32 reference (only if ``import torch``
                  works), ``common.torch_loop``: ``torch.autograd.grad`` for
                  fwd-bwd, ``loss.backward()`` without ``zero_grad`` for
                  accumulate, ``torch.optim.Adam.step()`` for adam (grads are not
                  divided by a count nor zeroed there). ``torch.set_num_threads``
                  is set to ``--threads``, else to OpenBLAS' thread count.

Timing (``common.run_workers``): every worker compiles and warms up first, one
after the other; then, for each round, the parent asks every worker in turn
(rotating the order each round) to time ``--calls`` back-to-back calls of each
function (``common.time_calls``, after ``--warmup`` calls); the table reports
the median over rounds of the per-round median time per call. The adam calls
after the first find an empty window: the guard's ``switch`` still computes
the rule, so the cost is the rule's. The float32 graphs are checked to
contain no float64 variable (floatX stays at its float64 default).

Run (about 2 minutes on 2 cores once compiled; the first run also compiles the
C and Numba code, roughly 2 more minutes, cached afterwards)::

    python benchmarks/backends.py            # full run
    python benchmarks/backends.py --quick    # smoke test, < 1 minute
    python benchmarks/backends.py --graphs   # also dprint the compiled graphs
    python benchmarks/backends.py --threads 1   # pin BLAS/OpenMP/torch threads

Multi-threaded BLAS is very sensitive to other load on a small machine (a
preempted BLAS thread stalls the whole GEMM): check the printed load average,
and compare the median table with the best-round lines.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

HERE = os.path.abspath(__file__)
sys.path.insert(0, os.path.dirname(HERE))

from common import (  # noqa: E402  (no heavy imports)
    have_module, inplace_writes, load_average, median, openblas_threads, per_call,
    run_workers, serve, time_calls, worker_io, worker_log,
)

DTYPES = ("float32", "float64")
KINDS = ("fwd-bwd", "accumulate", "adam")

CONFIGS = {
    "numba": {"mode": "NUMBA", "flags": ""},
    "c-blas": {"mode": "CVM", "flags": ""},
    "c-noblas": {"mode": "CVM", "flags": "blas__ldflags="},
    "jax": {"mode": "JAX", "flags": ""},
    "torch": {"mode": None, "flags": ""},
}


# --------------------------------------------------------------------------
# PyTensor worker
# --------------------------------------------------------------------------
def build_pytensor(dtype, mode):
    """fwd-bwd, and the library's accumulate and adam apply functions, all in `mode`."""
    import pytensor

    from common import batch, trainer

    xv, yv = batch(dtype)
    t0 = time.perf_counter()
    (x, y), params, loss, tr = trainer(dtype, mode=mode)
    assert loss.dtype == dtype, loss.dtype
    fns = {"fwd-bwd": pytensor.function([x, y], pytensor.grad(loss, params), mode=mode),
           "accumulate": tr.accumulate_fn, "adam": tr.apply_fn}
    compile_s = time.perf_counter() - t0
    accs = tr.accumulation.accumulators
    calls = {
        "fwd-bwd": lambda: fns["fwd-bwd"](xv, yv),
        "accumulate": lambda: fns["accumulate"](xv, yv),
        "adam": fns["adam"],
    }
    if mode == "JAX":  # JAX dispatches asynchronously: time until the results exist
        import jax

        def synced(call, shared):
            def run():
                out = call()
                jax.block_until_ready([out] + [v.get_value(borrow=True) for v in shared])
            return run

        calls = {
            "fwd-bwd": synced(calls["fwd-bwd"], []),
            "accumulate": synced(calls["accumulate"], accs),
            "adam": synced(lambda: fns["adam"](), params),
        }
    return fns, calls, accs, compile_s


def inspect_fn(fn, dtype, accs=()):
    """Summarise a compiled function: ops, non-C nodes, float64 leaks, Gemm on accs."""
    fg = fn.maker.fgraph
    nodes = fg.toposort()
    info = {"n_nodes": len(nodes), "ops": sorted({str(n.op) for n in nodes})}
    if dtype == "float32":
        info["float64_vars"] = sum(
            1 for v in fg.variables if getattr(v.type, "dtype", None) == "float64"
        )
    vm = getattr(fn, "vm", None)
    thunks = getattr(vm, "thunks", None)
    if thunks is not None and len(thunks) == len(vm.nodes):
        info["py_thunk_ops"] = sorted(
            {str(n.op) for n, th in zip(vm.nodes, thunks) if not hasattr(th, "cthunk")}
        )
    if accs:
        info["gemm_on_acc"] = [f"{op} on {name}" for name, ops in inplace_writes(fn, accs).items()
                               for op in ops if "Gemm" in op]
    return info


def worker_pytensor(name, args):
    import numpy as np
    import pytensor

    cfg = CONFIGS[name]
    meta = {
        "pytensor": pytensor.__version__,
        "numpy": np.__version__,
        "blas__ldflags": pytensor.config.blas__ldflags,
        "floatX": pytensor.config.floatX,
        "threads": openblas_threads(),
        "env": {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS")},
    }
    built = {}
    for dtype in DTYPES:
        fns, calls, accs, compile_s = build_pytensor(dtype, cfg["mode"])
        built[dtype] = calls
        meta[f"compile_s_{dtype}"] = round(compile_s, 2)
        meta[f"graph_{dtype}"] = {
            k: inspect_fn(f, dtype, accs if k == "accumulate" else ()) for k, f in fns.items()
        }
        if args.graphs:
            for k, f in fns.items():
                print(f"\n===== {name} {dtype} {k} =====", file=sys.stderr)
                pytensor.dprint(f, file=sys.stderr)
    return meta, built


# --------------------------------------------------------------------------
# PyTorch worker
# --------------------------------------------------------------------------
def worker_torch(name, args):
    import numpy as np
    import torch

    from common import set_torch_threads, torch_loop

    meta = {
        "torch": torch.__version__,
        "numpy": np.__version__,
        "torch_threads": set_torch_threads(args.threads),
        "threads": openblas_threads(),
    }
    loop = torch_loop("float32")
    # adam: opt.step alone, on the gradients the accumulate calls left in .grad
    return meta, {"float32": {"fwd-bwd": loop.fwd_bwd, "accumulate": loop.accumulate,
                              "adam": loop.opt.step}}


def worker_main(args):
    proto = worker_io()
    build = worker_torch if args.worker == "torch" else worker_pytensor
    meta, built = build(args.worker, args)
    for calls in built.values():  # JIT / first-call warm-up
        for k in KINDS:
            per_call(calls[k], 3)

    def measure(r):
        return {f"{dtype}/{k}": time_calls(calls[k], repeat=args.calls, warmup=args.warmup,
                                           stat="median") * 1e3
                for dtype, calls in built.items() for k in KINDS}

    serve(proto, meta, measure)


# --------------------------------------------------------------------------
# parent
# --------------------------------------------------------------------------
def worker_env(name):
    """os.environ plus the configuration's PyTensor flags."""
    env = dict(os.environ)
    flags = CONFIGS[name]["flags"]
    if flags:
        old = env.get("PYTENSOR_FLAGS", "")
        env["PYTENSOR_FLAGS"] = f"{old},{flags}" if old else flags
    return env


def fmt(v, width=8, prec=3):
    return f"{v:{width}.{prec}f}" if v is not None else " " * (width - 1) + "-"


def parent_main(args):
    t_start = time.perf_counter()
    load0 = os.getloadavg()
    names = (["numba", "c-blas", "c-noblas"] + (["jax"] if have_module("jax") else [])
             + (["torch"] if have_module("torch") else []))
    worker_args = ["--calls", str(args.calls), "--warmup", str(args.warmup)]
    if args.graphs:
        worker_args.append("--graphs")
    log = None if args.graphs or args.verbose else worker_log("backends-bench")
    # compile one at a time so that compilation does not skew the compile times
    meta, flat = run_workers(
        [dict(script=HERE, name=n, args=worker_args, threads=args.threads, env=worker_env(n))
         for n in names],
        args.rounds, args.max_seconds, log=log, one_at_a_time=True)
    samples = {n: {} for n in names}
    for key, v in flat.items():
        n, k = key.split("/", 1)
        samples[n][k] = v
    rounds_done = min(len(v) for v in flat.values())
    med = {n: {k: median(v) for k, v in s.items()} for n, s in samples.items()}
    best = {n: {k: min(v) for k, v in s.items()} for n, s in samples.items()}

    # ---- header ----
    pm = next(meta[n] for n in names if n != "torch")
    print(f"pytensor {pm['pytensor']}, numpy {pm['numpy']}, python {sys.version.split()[0]}"
          f", cpus {os.cpu_count()}")
    for n in names:
        m = meta[n]
        if n == "torch":
            print(f"  {n:9s} torch {m['torch']}, torch threads {m['torch_threads']}, "
                  f"openblas threads {m['threads']}")
            continue
        print(f"  {n:9s} mode={CONFIGS[n]['mode']} blas__ldflags={m['blas__ldflags']!r} "
              f"openblas threads {m['threads']} env {m['env']}")
        print(f"  {'':9s} compile s: f32 {m['compile_s_float32']}, f64 {m['compile_s_float64']}")
        g32 = m["graph_float32"]
        leaks = {k: v["float64_vars"] for k, v in g32.items() if v.get("float64_vars")}
        print(f"  {'':9s} float64 variables in float32 graphs: {leaks or 0}")
        if n == "numba":
            continue
        # the graphs are the same for both dtypes; report float32
        blas_ops = sorted({o for v in g32.values() for o in v["ops"]
                           if any(b in o for b in ("Gemm", "Dot", "Gemv", "Ger"))})
        py = sorted({o for v in g32.values() for o in v.get("py_thunk_ops", [])})
        print(f"  {'':9s} BLAS-type ops: {blas_ops}")
        print(f"  {'':9s} ops without C thunk (Python perform): {py or 'none'}")
        print(f"  {'':9s} accumulate: Gemm writing into an accumulator: "
              f"{g32['accumulate'].get('gemm_on_acc') or 'none'}")
        if not m["blas__ldflags"]:
            print(f"  {'':9s} NOTE: no C BLAS, but not BLAS-free: Dot22 runs numpy.dot in "
                  "Python and Gemm's C code calls PyArray_MatrixProduct2, both using "
                  "NumPy's bundled OpenBLAS")
    print(f"rounds {rounds_done} x {args.calls} calls (warm-up {args.warmup}); "
          f"ms/call = median over rounds of per-round median")
    print()

    # ---- table ----
    has_torch = "torch" in names
    hdr = (f"{'backend':9s} {'dtype':7s} {'fwd-bwd':>8s} {'accum':>8s} {'adam':>8s}"
           f" {'acc/fb':>7s} {'adam/acc':>8s}")
    if has_torch:
        hdr += f" {'acc/torch':>9s} {'adam/torch':>10s}"
    print(hdr)
    print("-" * len(hdr))
    tref = med.get("torch", {})
    for n in names:
        for dt in DTYPES:
            if f"{dt}/fwd-bwd" not in med[n]:
                continue
            fb, acc, ad = (med[n][f"{dt}/{k}"] for k in KINDS)
            row = (f"{n:9s} {dt:7s} {fmt(fb)} {fmt(acc)} {fmt(ad)}"
                   f" {fmt(acc / fb, 7, 2)} {fmt(ad / acc, 8, 3)}")
            if has_torch:
                ta, tad = tref.get("float32/accumulate"), tref.get("float32/adam")
                row += f" {fmt(acc / ta, 9, 2)} {fmt(ad / tad, 10, 2)}"
            print(row)
    print()
    if has_torch:
        print("ratios vs torch use torch float32 (backward-accumulate; optimizer.step)")
    print("best round (min over rounds), ms/call fwd-bwd / accum / adam:")
    for n in names:
        print(f"  {n:9s} " + "   ".join(
            f"{dt} " + " / ".join(f"{best[n][f'{dt}/{k}']:.3f}" for k in KINDS)
            for dt in DTYPES if f"{dt}/fwd-bwd" in best[n]))
    spread = max(
        (max(v) - min(v)) / median(v)
        for s in samples.values() for v in s.values()
    )
    print(f"load average at start {load0[0]:.2f}; at the end: {load_average()}")
    print(f"total {time.perf_counter() - t_start:.1f} s (compilation included); "
          f"max (max-min)/median over rounds {spread:.0%}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="few rounds/calls (smoke test)")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--calls", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--graphs", action="store_true", help="dprint compiled graphs to stderr")
    ap.add_argument("--max-seconds", type=float, default=None,
                    help="stop starting new rounds (after 2) once the timed phase took this long")
    ap.add_argument("--threads", type=int, default=0,
                    help="pin the workers' thread pools (OpenBLAS/OpenMP/MKL/Numba/XLA env,"
                    " torch); default: the libraries' defaults (torch: OpenBLAS' count)")
    ap.add_argument("--verbose", action="store_true", help="show workers' stderr")
    ap.add_argument("--worker", choices=sorted(CONFIGS), help=argparse.SUPPRESS)
    args = ap.parse_args()
    q = args.quick
    args.rounds = args.rounds or (2 if q else 7)
    args.calls = args.calls or (30 if q else 200)
    args.max_seconds = args.max_seconds or (30 if q else 200)
    args.warmup = args.warmup if args.warmup is not None else (3 if q else 10)
    if args.worker:
        worker_main(args)
    else:
        parent_main(args)


if __name__ == "__main__":
    main()
