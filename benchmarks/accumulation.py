#!/usr/bin/env python
"""Gradient accumulation with the library's defaults: the apply step and the memory.

Model: the 784-512-10 ReLU MLP of ``benchmarks/common.py`` (mean cross-entropy),
batch 64, float32 and float64. "ours" is
``lasagne_accum.compile_accumulation(..., update_rule=lasagne_accum.adam)`` with
its default modes (``default_modes()``: the faster of C and Numba for each step,
measured on the machine), driven by ``trainer.step()`` in windows of ``--every`` batches.

Measured (the memory items are checked in the final summary; the speed ratios
are printed without a target: the accumulate step against a forward-backward
call is ``benchmarks/inplace.py``'s topic, measured there call by call):

1. forward-backward calls (``pytensor.function([x, y], grads)`` compiled in CVM
   and in NUMBA), timed beside the steps, in the ms table only;
2. that the accumulate step allocates no parameter-sized array per call:
   tracemalloc peak during one call minus the traced memory before it (numpy
   and Numba's runtime register their data allocations with tracemalloc),
   compared with W1's size; plus the in-place ops on the accumulators in the
   compiled graph (``destroy_map``) and whether the buffers keep their address;
3. accumulate step and adam apply step vs PyTorch's own loop on the same model,
   float32, in its own process (``loss.backward()`` accumulating into ``.grad``;
   ``torch.optim.Adam.step()`` + ``zero_grad()`` as the apply step:
   ``common.torch_loop``), torch threads = ``--threads``, else OpenBLAS threads;
4. apply step / accumulate step;
5. peak memory of one effective batch of N*B examples by accumulation
   (N accumulate calls + 1 apply, B at a time) vs one plain N*B batch
   (one call of a CVM function computing the grads and applying adam),
   N = 1, 2, 4, 8, 16 (``--quick``: 1, 4, 16), in the PyTensor worker;
6. a naive loop (fwd-bwd function returning the grads, ``acc += g`` in numpy),
   in the ms table only.

Timing (``common.run_workers``): one persistent worker process for PyTensor
(both dtypes) and one for torch; each round the parent asks each worker in turn
(alternating the order) to time every kind of call; within a round the kinds
alternate every ~20 calls (rotating their order), so that load bursts hit all
kinds alike; each kind's number is the median over rounds of the per-round
median per call.

    python benchmarks/accumulation.py              # full run (~2-4 minutes)
    python benchmarks/accumulation.py --quick      # smoke test (< 90 s)
    python benchmarks/accumulation.py --threads 1  # pin OpenBLAS/OpenMP/Numba/torch threads
    python benchmarks/accumulation.py --profile    # also PyTensor profiles, in the worker log
    python benchmarks/accumulation.py --memory-only  # items 2 and 5 (docs/performance.rst)
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

T_START = time.perf_counter()
HERE = os.path.abspath(__file__)
sys.path.insert(0, os.path.dirname(HERE))

from common import (  # noqa: E402  (no heavy imports)
    BATCH, LR, SIZES, THREAD_VARS, have_module, inplace_writes, openblas_threads, per_call,
    run_workers, serve, time_windows, worker_io, worker_log,
)

DTYPES = ("float32", "float64")
MEM_NS = (1, 2, 4, 8, 16)
MEM_FLAT = 0.10   # the claim of item 5: accumulation's memory varies by at most 10% over N


# --------------------------------------------------------------------------
# helpers (run in the workers)
# --------------------------------------------------------------------------
def shared_inputs(*fns):
    from pytensor.compile.sharedvalue import SharedVariable

    seen = {}
    for fn in fns:
        for i in fn.maker.inputs:
            if isinstance(i.variable, SharedVariable):
                seen[id(i.variable)] = i.variable
    return list(seen.values())


def allocs_in(fn):
    """Alloc nodes of a compiled graph, as 'Alloc(shape of X)' strings."""
    out = []
    for node in fn.maker.fgraph.toposort():
        if type(node.op).__name__ == "Alloc":
            shape_of = sorted({str(i.owner.inputs[0]) for i in node.inputs[1:] if i.owner})
            out.append(f"Alloc(zeros like {'/'.join(shape_of) or '?'})")
    return out


def traced_call(fn, repeat=10):
    """Max over `repeat` calls of (tracemalloc peak during the call - traced before)."""
    import tracemalloc

    gc.collect()
    tracemalloc.start()
    peaks, nets = [], []
    try:
        for _ in range(repeat):
            before = tracemalloc.get_traced_memory()[0]
            tracemalloc.reset_peak()
            fn()
            cur, peak = tracemalloc.get_traced_memory()
            peaks.append(peak - before)
            nets.append(cur - before)
    finally:
        tracemalloc.stop()
    return max(peaks), max(nets)


# --------------------------------------------------------------------------
# PyTensor timing worker
# --------------------------------------------------------------------------
def build_pt(dtype, every):
    import numpy as np
    import pytensor

    from common import batch, trainer

    t0 = time.perf_counter()
    (x, y), params, loss, tr = trainer(dtype, every=every)
    grads = pytensor.grad(loss, params)
    fb = {m: pytensor.function([x, y], grads, mode=m) for m in ("CVM", "NUMBA")}
    compile_s = time.perf_counter() - t0
    xv, yv = batch(dtype)
    naive_acc = [np.zeros_like(p.get_value()) for p in params]

    def naive(f):
        def call():
            for a, g in zip(naive_acc, f(xv, yv)):
                a += g
        return call

    calls = {
        "fb-CVM": lambda: fb["CVM"](xv, yv),
        "fb-NUMBA": lambda: fb["NUMBA"](xv, yv),
        "naive-CVM": naive(fb["CVM"]),
        "naive-NUMBA": naive(fb["NUMBA"]),
    }
    return dict(trainer=tr, params=params, fb=fb, calls=calls, data=(xv, yv),
                compile_s=compile_s, naive_acc=naive_acc)


def time_window(trainer, data, windows):
    """Accumulate/apply times (s) over `windows` windows of trainer.every batches."""
    assert trainer.pending == 0
    return time_windows(trainer.accumulate_fn, trainer.apply_fn, trainer.every, windows, data)


def memory_checks(b):
    """Item 2 evidence (and the same numbers for fwd-bwd / apply as contrast)."""
    trainer, params = b["trainer"], b["params"]
    accs = trainer.accumulation.accumulators
    xv, yv = b["data"]
    acc_fn, apply_fn = trainer.accumulate_fn, trainer.apply_fn
    addr0 = [a.get_value(borrow=True).ctypes.data for a in accs]
    acc_peak, acc_net = traced_call(lambda: acc_fn(xv, yv))
    addr1 = [a.get_value(borrow=True).ctypes.data for a in accs]
    fb_peak, _ = traced_call(lambda: b["fb"]["CVM"](xv, yv))
    apply_fn()
    apply_only = []
    for _ in range(3):  # the apply call alone (after one accumulate call)
        acc_fn(xv, yv)
        apply_only.append(traced_call(apply_fn, repeat=1)[0])
    return {
        "W1_bytes": params[0].get_value(borrow=True).nbytes,
        "acc_peak": acc_peak, "acc_net": acc_net,
        "acc_same_buffers": addr0 == addr1,
        "fb_cvm_peak": fb_peak, "apply_peak": max(apply_only),
        "inplace_acc": inplace_writes(acc_fn, accs),
        "apply_allocs": allocs_in(apply_fn),
        "apply_inplace_params": inplace_writes(apply_fn, params),
    }


def worker_pt(args):
    import numpy as np
    import numba
    import pytensor

    proto = worker_io()
    phases = {"import": time.perf_counter() - T_START}
    t0 = time.perf_counter()
    built = {dt: build_pt(dt, args.every) for dt in DTYPES}
    phases["compile"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    for b in built.values():  # JIT / first-call warm-up
        for f in b["calls"].values():
            per_call(f, 3)
        time_window(b["trainer"], b["data"], 2)
    phases["warm-up"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    mem = {dt: memory_checks(b) for dt, b in built.items()}
    mem5 = memory_table(built["float32"]["trainer"], args.mem_ns)
    phases["memory"] = time.perf_counter() - t0
    meta = {
        "pytensor": pytensor.__version__, "numpy": np.__version__, "numba": numba.__version__,
        "blas__ldflags": pytensor.config.blas__ldflags, "floatX": pytensor.config.floatX,
        "openblas_threads": openblas_threads(),
        "numba_threads": numba.config.NUMBA_NUM_THREADS,
        "env": {k: os.environ.get(k) for k in THREAD_VARS},
        "compile_s": {dt: round(b["compile_s"], 1) for dt, b in built.items()},
        "modes": {dt: [str(b["trainer"].accumulate_fn.maker.mode.linker),
                       str(b["trainer"].apply_fn.maker.mode.linker)]
                  for dt, b in built.items()},
        "mem": mem, "mem5": mem5,
        "phases": {k: round(v, 1) for k, v in phases.items()},
    }

    def measure(r):
        times = {}
        n_slices = max(1, args.calls // 20)  # kinds alternate every ~20 calls
        calls = max(1, args.calls // n_slices)
        windows = max(1, calls // args.every)
        for dt in DTYPES[r % 2:] + DTYPES[:r % 2]:
            b = built[dt]
            kinds = list(b["calls"]) + ["window"]
            for sl in range(n_slices):
                k0 = (r + sl) % len(kinds)
                for k in kinds[k0:] + kinds[:k0]:
                    if k == "window":
                        a, p = time_window(b["trainer"], b["data"], windows)
                        times.setdefault(f"{dt}/acc", []).extend(a)
                        times.setdefault(f"{dt}/apply", []).extend(p)
                    else:
                        times.setdefault(f"{dt}/{k}", []).extend(
                            per_call(b["calls"][k], calls))
        return {k: statistics.median(v) for k, v in times.items()}

    serve(proto, meta, measure)
    if args.profile:  # after the timing: profiled functions are separate copies
        profile_trainer(args)


def profile_trainer(args):
    """PyTensor profiles of the library's two functions and fwd-bwd (CVM), to stderr."""
    import pytensor

    from common import batch, trainer

    for dt in DTYPES:
        with pytensor.config.change_flags(profile=True):
            (x, y), params, loss, tr = trainer(dt, every=args.every)
            fb = pytensor.function([x, y], pytensor.grad(loss, params), mode="CVM")
        xv, yv = batch(dt)
        for _ in range(300):
            for _ in range(args.every):
                tr.accumulate_fn(xv, yv)
                fb(xv, yv)
            tr.apply_fn()
        for name, f in (("fwd-bwd CVM", fb), ("accumulate", tr.accumulate_fn),
                        ("apply", tr.apply_fn)):
            print(f"\n######## profile {dt} {name}", file=sys.stderr)
            f.profile.summary(file=sys.stderr)


# --------------------------------------------------------------------------
# torch timing worker
# --------------------------------------------------------------------------
def worker_torch(args):
    import torch

    from common import set_torch_threads, torch_loop

    proto = worker_io()
    meta = {"torch": torch.__version__, "torch_threads": set_torch_threads(args.threads),
            "openblas_threads": openblas_threads(), "mkl": torch.backends.mkl.is_available()}
    loop = torch_loop("float32")

    def measure(r):
        a, p = time_windows(loop.accumulate, loop.apply, args.every,
                            max(1, args.calls // args.every))
        return {"float32/torch-acc": statistics.median(a),
                "float32/torch-apply": statistics.median(p)}

    time_windows(loop.accumulate, loop.apply, args.every, 3)  # warm-up
    serve(proto, meta, measure)


# --------------------------------------------------------------------------
# peak memory of one effective batch (item 5), in the PyTensor worker
# --------------------------------------------------------------------------
def memory_table(trainer, ns):
    """tracemalloc peak of one effective batch of n*B examples, accumulated vs plain.

    `trainer` is the library's float32 trainer (its ``every`` is set to n for
    the measurement and restored); the plain batch is one call of a CVM
    function computing the grads of the n*B batch and applying adam (its own
    copy of the model). Inputs are created inside the measured window.
    """
    import tracemalloc

    import numpy as np
    import pytensor

    import lasagne_accum as la
    from common import mlp

    dtype, B = "float32", BATCH
    (x, y), params, loss = mlp(dtype)
    plain = pytensor.function([x, y], loss, updates=la.adam(loss, params, LR), mode="CVM")
    state = {"accum": shared_inputs(trainer.accumulate_fn, trainer.apply_fn),
             "plain": shared_inputs(plain)}
    rng = np.random.default_rng(1)

    def data(size):  # float32 directly: no float64 temporary
        return (rng.random((size, SIZES[0]), dtype=np.float32),
                rng.integers(0, SIZES[2], size=size, dtype=np.int64))

    def run(method, n):
        if method == "accum":
            for _ in range(n):
                xb, yb = data(B)
                trainer.step(xb, yb)
                del xb, yb
            assert trainer.pending == 0
        else:
            xb, yb = data(n * B)
            plain(xb, yb)
            del xb, yb

    every = trainer.every
    out = {}
    try:
        for method in ("accum", "plain"):
            for n in ns:
                trainer.every = n
                run(method, n)  # warm-up: first-call allocations at this size
                gc.collect()
                tracemalloc.start()
                try:
                    before = tracemalloc.get_traced_memory()[0]
                    tracemalloc.reset_peak()
                    run(method, n)
                    peak = tracemalloc.get_traced_memory()[1] - before
                finally:
                    tracemalloc.stop()
                out.setdefault(method, {})[n] = {
                    "state": sum(np.asarray(v.get_value(borrow=True)).nbytes
                                 for v in state[method]),
                    "peak": peak,
                    "inputs": (B if method == "accum" else n * B) * (SIZES[0] * 4 + 8),
                }
    finally:
        trainer.every = every
    out["acc_set"] = sum(a.get_value(borrow=True).nbytes
                         for a in trainer.accumulation.accumulators)
    return out


# --------------------------------------------------------------------------
# parent
# --------------------------------------------------------------------------
def worker_args(args):
    out = ["--calls", str(args.calls), "--every", str(args.every)]
    if args.profile:
        out.append("--profile")
    if args.quick:
        out.append("--quick")
    return out


def mb(nbytes):
    return f"{nbytes / 2**20:7.2f}" if nbytes is not None else "      -"


def verdict(ok):
    return "PASS" if ok else "MISS"


def parent_main(args):
    t_start = time.perf_counter()
    load0 = os.getloadavg()
    log = worker_log("accumulation-bench")
    use_torch = have_module("torch") and not args.memory_only

    # ---- workers: compile, warm up and measure memory, then interleaved rounds ----
    names = ["pytensor"] + (["torch"] if use_torch else [])
    meta, flat = run_workers(
        [dict(script=HERE, name=n, args=worker_args(args), threads=args.threads) for n in names],
        0 if args.memory_only else args.rounds, args.max_seconds, log=log)
    # ---- header ----
    pm = meta["pytensor"]
    print(f"pytensor {pm['pytensor']}, numpy {pm['numpy']}, numba {pm['numba']}, "
          + (f"torch {meta['torch']['torch']}, " if use_torch
             else "" if args.memory_only else "torch: not installed, ")
          + f"python {sys.version.split()[0]}, cpus {os.cpu_count()}")
    print(f"blas__ldflags: {pm['blas__ldflags']!r}; floatX {pm['floatX']}")
    print(f"threads: --threads {args.threads or 'not given (library defaults)'}; env "
          + ", ".join(f"{k}={v}" for k, v in pm["env"].items())
          + f"; OpenBLAS (system / numpy's) {pm['openblas_threads'].get('system_openblas')}"
          f" / {pm['openblas_threads'].get('numpy_openblas')}; numba {pm['numba_threads']}"
          + (f"; torch {meta['torch']['torch_threads']} (MKL {meta['torch']['mkl']})"
             if use_torch else ""))
    print(f"library modes (linker of accumulate / apply): {pm['modes']['float32']}; "
          f"PyTensor worker setup s: {pm['phases']}")
    if not args.memory_only:   # ---- the speed tables ----
        # keys "pytensor/float32/acc" -> "float32/acc", seconds -> ms
        samples = {k.split("/", 1)[1]: [t * 1e3 for t in v] for k, v in flat.items()}
        rounds = min(len(v) for v in samples.values())
        med = {k: statistics.median(v) for k, v in samples.items()}
        best = {k: min(v) for k, v in samples.items()}
        spread = {k: (max(v) - min(v)) / statistics.median(v) for k, v in samples.items()}

        print(f"model 784-512-10 ReLU MLP, batch {BATCH}, adam lr {LR:g}, windows of "
              f"{args.every} batches; {rounds} rounds x {args.calls} calls per kind; "
              "ms = median over rounds of the per-round median per call")
        print()

        # ---- table 1/3/4/6 ----
        def g(key):
            return med.get(key)

        rows = [("fwd-bwd CVM (grads as outputs)", "fb-CVM"),
                ("fwd-bwd NUMBA", "fb-NUMBA"),
                ("accumulate step (ours, CVM)", "acc"),
                ("apply step adam (ours, NUMBA)", "apply"),
                ("naive: fb CVM + numpy acc += g", "naive-CVM"),
                ("naive: fb NUMBA + numpy acc += g", "naive-NUMBA"),
                ("torch backward-accumulate", "torch-acc"),
                ("torch Adam.step + zero_grad", "torch-apply")]
        print(f"{'ms per call':38s} {'float32':>9s} {'float64':>9s}   spread f32/f64")
        print("-" * 76)
        for label, k in rows:
            vals = [g(f"{dt}/{k}") for dt in DTYPES]
            sp = [spread.get(f"{dt}/{k}") for dt in DTYPES]
            print(f"{label:38s} " + " ".join(f"{v:9.3f}" if v else f"{'-':>9s}" for v in vals)
                  + "   " + " / ".join(f"{s:.0%}" if s is not None else "-" for s in sp))
        print()
        ratios = {}
        for dt in DTYPES:
            ratios[dt] = {"apply/acc": (g(f"{dt}/apply") / g(f"{dt}/acc"), "")}
            if use_torch and dt == "float32":
                ratios[dt]["acc/torch"] = (g(f"{dt}/acc") / g("float32/torch-acc"), "")
                ratios[dt]["apply/torch"] = (g(f"{dt}/apply") / g("float32/torch-apply"), "")
        labels = [("3a", "acc/torch", "accumulate / torch accumulate"),
                  ("3b", "apply/torch", "apply / torch step+zero_grad"),
                  ("4", "apply/acc", "apply / accumulate")]
        print(f"{'ratio (no target)':40s} {'float32':>16s} {'float64':>16s}")
        print("-" * 75)
        for num, key, label in labels:
            cells = []
            for dt in DTYPES:
                v = ratios[dt].get(key)
                cells.append(f"{v[0]:6.3f}" + (f" (vs {v[1]})" if v[1] else "")
                             if v else "-")
            print(f"{num:>2} {label:37s} {cells[0]:>16s} {cells[1]:>16s}")
        nan = float("nan")
        print("best round (min over rounds) ms f32/f64: " + ", ".join(
            f"{k} {best.get('float32/' + k, nan):.3f}/{best.get('float64/' + k, nan):.3f}"
            for k in ("fb-CVM", "fb-NUMBA", "acc", "apply", "naive-CVM"))
            + (f", torch acc {best['float32/torch-acc']:.3f}, torch step "
               f"{best['float32/torch-apply']:.3f}" if use_torch else ""))

        def bratio(dt, num, den):
            return best.get(f"{dt}/{num}", nan) / best.get(den if "/" in den else f"{dt}/{den}", nan)

        print("best-round ratios f32/f64: "
              + (f"3a {bratio('float32', 'acc', 'float32/torch-acc'):.2f}, 3b "
                 f"{bratio('float32', 'apply', 'float32/torch-apply'):.2f}, " if use_torch else "")
              + "4 " + "/".join(f"{bratio(dt, 'apply', 'acc'):.2f}" for dt in DTYPES))
        print()
    else:
        print(f"model 784-512-10 ReLU MLP, batch {BATCH}, adam, windows of {args.every} "
              "batches; --memory-only: no timing rounds")
    print()

    # ---- item 2 ----
    print("2. allocations of one call (tracemalloc: peak during the call - traced before; "
          "max over 10 calls), MB")
    print(f"   {'dtype':8s} {'W1 size':>8s} {'accum':>8s} {'(net)':>8s} {'fwd-bwd':>8s} "
          f"{'apply':>8s}  same acc buffers after call")
    for dt in DTYPES:
        m = pm["mem"][dt]
        print(f"   {dt:8s} {mb(m['W1_bytes'])}  {mb(m['acc_peak'])}  {mb(m['acc_net'])}  "
              f"{mb(m['fb_cvm_peak'])}  {mb(m['apply_peak'])}  {m['acc_same_buffers']}")
    m32 = pm["mem"]["float32"]
    mem = pm["mem5"]
    ns = args.mem_ns
    print("   in-place writes into the accumulators (accumulate graph): "
          + ", ".join(f"{k}: {'+'.join(v) or 'NONE'}" for k, v in m32["inplace_acc"].items()))
    print("   apply graph: in-place on params: "
          + ", ".join(f"{k}: {'+'.join(v) or 'NONE'}"
                      for k, v in m32["apply_inplace_params"].items())
          + f"; allocations: {', '.join(m32['apply_allocs']) or 'none'}")
    print()

    # ---- item 5 ----
    print("5. peak memory of one effective batch of N*64 examples, float32, MB: tracemalloc "
          "(numpy + Numba runtime allocations), reset_peak per cell after a warm-up at that size.")
    print("   Inputs are created inside the measured window and INCLUDED (accumulation holds "
          "one 64-batch at a time, the plain step all N*64).")
    print("   total = persistent shared state (params, adam m/v, + accumulators for accum) "
          "+ transient peak; plain = one CVM call: grads of the N*64 batch + adam")
    hdr = (f"   {'N':>3s} {'inputs acc/plain':>16s} | {'acc state':>9s} {'peak':>7s} "
           f"{'total':>7s} | {'plain st':>8s} {'peak':>7s} {'total':>7s} | acc/plain")
    print(hdr)
    print("   " + "-" * (len(hdr) - 3))
    tot = {m: {n: mem[m][str(n)]["state"] + mem[m][str(n)]["peak"] for n in ns}
           for m in ("accum", "plain")}
    for n in ns:
        a, p = mem["accum"][str(n)], mem["plain"][str(n)]
        print(f"   {n:3d} {mb(a['inputs'])} /{mb(p['inputs'])} | {mb(a['state']):>9s} "
              f"{mb(a['peak'])} {mb(tot['accum'][n])} | {mb(p['state']):>8s} {mb(p['peak'])} "
              f"{mb(tot['plain'][n])} | {tot['accum'][n] / tot['plain'][n]:.2f}")
    acc_set = mem["acc_set"]
    flat = max(tot["accum"].values()) / min(tot["accum"].values()) - 1
    bound = 1.10 * tot["plain"][1] + acc_set
    within = max(tot["accum"].values()) <= bound
    grow = tot["plain"][ns[-1]] / tot["plain"][1]
    print(f"   accumulation total over N varies by {flat:.1%} (claim: <= 10%); max "
          f"{max(tot['accum'].values()) / 2**20:.2f} MB vs 1.10 x plain(N=1) + one accumulator "
          f"set ({acc_set / 2**20:.2f} MB) = {bound / 2**20:.2f} MB; plain grows x{grow:.2f} "
          f"from N=1 to N={ns[-1]}")
    print()

    # ---- summary ----
    print("SUMMARY of the memory claims (claim: measured -> verdict)")
    results = []
    for dt in DTYPES:
        m = pm["mem"][dt]
        ok = (m["acc_peak"] < m["W1_bytes"] and m["acc_same_buffers"]
              and all(m["inplace_acc"].values()))
        results.append((f" 2 accumulate allocates no param-sized array [{dt}]",
                        f"peak {m['acc_peak'] / 2**20:.2f} MB < W1 "
                        f"{m['W1_bytes'] / 2**20:.2f} MB, in place on every "
                        f"accumulator, same buffers", ok))
    results.append((" 5 accumulation memory flat (<= 10%) and <= 1.1 plain(1) + acc set",
                    f"{flat:.1%}, {max(tot['accum'].values()) / 2**20:.2f} <= "
                    f"{bound / 2**20:.2f} MB", flat <= MEM_FLAT and within))
    results.append((" 5 plain batch memory grows with N", f"x{grow:.2f}", grow > 1.10 + flat))
    for label, val, ok in results:
        print(f"  {verdict(ok)}  {label:58s} {val}")
    if not args.memory_only:
        print("  info 4 amortised per batch (apply / (every x accumulate)): "
              + ", ".join(f"{dt} {ratios[dt]['apply/acc'][0] / args.every:.3f}"
                          for dt in DTYPES))
    load1 = os.getloadavg()
    print(f"load average (1/5/15 min) at start {load0[0]:.2f}/{load0[1]:.2f}/{load0[2]:.2f}, "
          f"end {load1[0]:.2f}/{load1[1]:.2f}/{load1[2]:.2f}")
    print(f"runtime: total {time.perf_counter() - t_start:.0f} s (compilation included); "
          f"the workers' log is {os.path.basename(log.name)} in the temporary directory")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="few rounds and calls (< 90 s)")
    ap.add_argument("--threads", type=int, default=0,
                    help="pin the workers' thread pools (OpenBLAS/OpenMP/MKL/Numba/XLA env,"
                    " torch); default: the libraries' defaults (torch: OpenBLAS' count)")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--calls", type=int, default=None, help="calls per kind per round")
    ap.add_argument("--every", type=int, default=4, help="batches per window (apply step)")
    ap.add_argument("--max-seconds", type=float, default=None,
                    help="stop starting rounds (after 2) once timing took this long")
    ap.add_argument("--profile", action="store_true",
                    help="print PyTensor profiles of the functions to the worker log")
    ap.add_argument("--memory-only", action="store_true",
                    help="measure only the memory (items 2 and 5): no timing rounds, no torch "
                    "worker; what docs/performance.rst shows (timings are other topics')")
    ap.add_argument("--worker", choices=("pytensor", "torch"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    q = args.quick
    args.rounds = args.rounds or (3 if q else 9)
    args.calls = args.calls or (40 if q else 160)
    args.max_seconds = args.max_seconds or (25 if q else 150)
    args.mem_ns = (1, 4, 16) if q else MEM_NS
    if args.worker == "pytensor":
        worker_pt(args)
    elif args.worker == "torch":
        worker_torch(args)
    else:
        parent_main(args)


if __name__ == "__main__":
    main()
