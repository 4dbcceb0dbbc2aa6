#!/usr/bin/env python
"""Ours against PyTorch and optax, and the Adam apply step against the copy bandwidth.

Same model (``common.mlp``: 784-512-10 ReLU MLP, mean cross-entropy, the same
initial values), same batch of 64, float32 and float64 (``--dtypes``), a window
of ``--every`` = 4 accumulated batches followed by one Adam step (lr 1e-3):

* ``ours``: ``lasagne_accum.compile_accumulation(..., update_rule=adam)`` with
  the library's default modes, ``trainer.accumulate_fn`` x4 + ``apply_fn``;
  ``ours-numba``: the README's recipe compiled with plain
  ``pytensor.function`` (PyTensor 3's default, Numba) for both functions;
* ``torch``: PyTorch's accumulation loop, ``(loss / 4).backward()`` x4,
  ``Adam.step()``, ``zero_grad()``;
* ``optax``: ``optax.MultiSteps(optax.adam(1e-3), every_k_schedule=4)`` in one
  ``jax.jit``-compiled step, called 4 times, each call waited for
  (``block_until_ready``); ``optax-donated``: the same step compiled with
  ``donate_argnums=(0, 1)``, so that parameters and optimizer state are updated
  in place. The summary holds ours against the faster of the two.

Each library (``ours`` and ``ours-numba`` too) runs in its own process, once
with 1 thread and once with 2 (thread variables and CPU affinity pinned); the
processes are timed in interleaved rounds; a number is the median over rounds
of the per-round median. Every call is timed alone too (no Python outside the
calls is counted on any side), and the table's second part shows a window's
accumulating calls and its last call apart. ``ours`` and ``ours-numba`` run in
processes of their own: in a shared one the C backend's OpenBLAS threads, still
spinning after a call, slow the next Numba call (scipy's own OpenBLAS).

Item 4 (in the ``ours`` worker): the apply step's bytes moved per call (every
shared array it reads plus every one it writes, i.e. the least traffic the
step needs) divided by its time, beside the bandwidth of ``numpy.copyto`` of a
float32 array as large as all parameters together (2 x its bytes per copy),
timed alternately in the same process. It is a diagnostic, printed without a
target: that copy may run from the CPU's cache while the apply step's traffic
(several times larger) does not, so the ratio depends on the machine's caches.

    python benchmarks/peers.py            # about 3-5 minutes on 2 busy cores
    python benchmarks/peers.py --quick    # smoke test
"""

from __future__ import annotations

import argparse
import os
import sys
import time

HERE = os.path.abspath(__file__)
sys.path.insert(0, os.path.dirname(HERE))

from common import (  # noqa: E402  (no heavy imports)
    LR, batch, have_module, load_average, median, mlp, per_call, run_workers, trainer,
    worker_log, pin_cpus, serve, worker_io,
)


# --------------------------------------------------------------------------
# workers
# --------------------------------------------------------------------------
def _timed_window(calls, last):
    """A window function: ``calls()`` x (every - 1) and ``last()``, each call timed.

    Returns ``window(times)`` appending (seconds of each of the first calls,
    seconds of the last) to `times`.
    """
    clock = time.perf_counter

    def window(every, times):
        first = []
        for _ in range(every - 1):
            t0 = clock()
            calls()
            first.append(clock() - t0)
        t0 = clock()
        last()
        times.append((first, clock() - t0))

    return window


def _window_result(times):
    """Median window, median accumulating call and median stepping call (s)."""
    return {"window": median(sum(f) + s for f, s in times),
            "call": median(t for f, _ in times for t in f),
            "step": median(s for _, s in times)}


def worker_ours(args, proto):
    """``ours``: compile_accumulation's default modes; ``ours-numba``: the README's
    recipe with plain ``pytensor.function`` (Numba). One variant per process, so
    that one variant's BLAS threads (C: the system OpenBLAS; Numba: scipy's) never
    spin beside the other's."""
    import numpy as np
    import pytensor

    import lasagne_accum as la

    every, dtype = args.every, args.dtype
    xv, yv = batch(dtype)
    if args.worker == "ours":
        _, params, _, tr = trainer(dtype, every=every)
        acc_fn, apply_fn = tr.accumulate_fn, tr.apply_fn
    else:  # the README's recipe with plain pytensor.function (PyTensor's default mode)
        (x, y), params, loss = mlp(dtype)
        acc = la.accumulate_gradients(loss, params)
        apply = acc.guard(la.adam(acc.grads, params, LR))
        apply.update(acc.reset)
        acc_fn = pytensor.function([x, y], loss, updates=acc.accumulate)
        apply_fn = pytensor.function([], [], updates=apply)

    def last():
        acc_fn(xv, yv)
        apply_fn()

    window = _timed_window(lambda: acc_fn(xv, yv), last)

    # item 4: bytes the apply step must move, and a copy of the parameters' size
    shared = {id(i.variable): i.variable for i in apply_fn.maker.inputs if i.implicit}
    read = sum(np.asarray(v.get_value(borrow=True)).nbytes for v in shared.values())
    written = sum(np.asarray(i.variable.get_value(borrow=True)).nbytes
                  for i in apply_fn.maker.inputs if i.update is not None)
    n_param = sum(p.get_value(borrow=True).size for p in params)
    src = np.random.rand(n_param).astype(dtype)
    dst = np.empty_like(src)

    for _ in range(3):  # warm-up (JIT, first-call allocations)
        window(every, [])
    meta = {"cpus": args.cpus, "modes": [str(f.maker.mode.linker) for f in (acc_fn, apply_fn)],
            "apply_bytes": read + written, "copy_bytes": 2 * src.nbytes,
            "param_bytes": src.nbytes}

    def measure(r):
        times = []
        for _ in range(args.windows):
            window(every, times)
        out = _window_result(times)
        apply_t, copy_t = [], []
        for _ in range(args.windows):  # item 4: apply after a real window, copies between
            for _ in range(every):
                acc_fn(xv, yv)
            apply_t += per_call(apply_fn, 1)
            copy_t += per_call(np.copyto, 3, (dst, src))
        out["apply"], out["copy"] = median(apply_t), median(copy_t)
        return out

    serve(proto, meta, measure)


def worker_torch(args, proto):
    import torch

    from common import torch_mlp

    torch.set_num_threads(args.threads)
    params, loss_fn = torch_mlp(args.dtype)
    xv, yv = batch(args.dtype)
    x, y = torch.from_numpy(xv), torch.from_numpy(yv)
    opt = torch.optim.Adam(params, lr=LR)
    every = args.every

    def accumulate():
        (loss_fn(params, x, y) / every).backward()  # sums into .grad: the mean

    def last():
        accumulate()
        opt.step()
        opt.zero_grad()

    window = _timed_window(accumulate, last)

    def measure(r):
        times = []
        for _ in range(args.windows):
            window(every, times)
        return _window_result(times)

    for _ in range(5):
        window(every, [])
    meta = {"cpus": args.cpus, "torch": torch.__version__, "threads": torch.get_num_threads()}
    serve(proto, meta, measure)


def worker_optax(args, proto):
    import jax
    import optax

    from common import jax_mlp

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_enable_x64", args.dtype == "float64")
    params, loss_fn = jax_mlp(args.dtype)
    xv, yv = batch(args.dtype)
    x, y = jax.device_put(xv), jax.device_put(yv)
    opt = optax.MultiSteps(optax.adam(LR), every_k_schedule=args.every)
    state = [params, opt.init(params)]

    def step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    step = jax.jit(step, donate_argnums=(0, 1) if args.worker == "optax-donated" else ())

    def call():
        p, s, loss = step(state[0], state[1], x, y)
        jax.block_until_ready((p, s, loss))
        state[0], state[1] = p, s

    window = _timed_window(call, call)  # MultiSteps steps on the every-th call itself

    def measure(r):
        times = []
        for _ in range(args.windows):
            window(args.every, times)
        return _window_result(times)

    for _ in range(5):
        window(args.every, [])
    meta = {"cpus": args.cpus, "jax": jax.__version__, "optax": optax.__version__}
    serve(proto, meta, measure)


WORKERS = {"ours": worker_ours, "ours-numba": worker_ours, "torch": worker_torch,
           "optax": worker_optax, "optax-donated": worker_optax}


# --------------------------------------------------------------------------
# parent
# --------------------------------------------------------------------------
def parent_main(args):
    t0 = time.perf_counter()
    print(load_average())
    have = {"torch": have_module("torch"), "optax": have_module("optax")}
    missing = sorted(k for k, v in have.items() if not v)
    optaxes = ["optax", "optax-donated"] if have["optax"] else []
    peers = (["torch"] if have["torch"] else []) + optaxes
    names = ["ours", "ours-numba", *peers]
    log = worker_log("peers-bench")
    verdicts = []
    for dtype in args.dtypes:
        verdicts += _one_dtype(args, dtype, names, peers, optaxes, missing, log)
    print("SUMMARY (target: measured -> verdict; optax: the faster of jit and donated)")
    for label, v, target in verdicts:
        print(f"  {'PASS' if v <= target else 'MISS'}  {label:45s} <= {target}: {v:.3f}")
    print(load_average())
    print(f"total {time.perf_counter() - t0:.0f} s; worker log {log.name}")


def _one_dtype(args, dtype, names, peers, optaxes, missing, log):
    """Every library at every thread count in one interleaved run; prints the
    tables of `dtype` and returns its verdicts."""
    meta, samples = run_workers(
        [dict(script=HERE, name=name, threads=t, label=f"{name}@{t}",
              args=["--every", str(args.every), "--windows", str(args.windows),
                    "--dtype", dtype])
         for t in args.thread_counts for name in names],
        args.rounds, args.max_seconds, log=log)
    med = {k: median(v) * 1e3 for k, v in samples.items()}
    rounds = min(len(v) for v in samples.values())

    m = meta[f"ours@{args.thread_counts[0]}"]
    print(f"## {dtype}")
    print(f"model 784-512-10 ReLU MLP, {dtype}, batch 64, windows of {args.every} batches + "
          f"one Adam step; {rounds} interleaved rounds x {args.windows} windows; ms = median "
          "over rounds of the per-round median; one process per library and thread count")
    first = args.thread_counts[0]
    print(f"ours: compile_accumulation default modes (accumulate / apply linker) {m['modes']}; "
          "ours-numba: plain pytensor.function (Numba)"
          + "".join(f"; {p} {meta[f'{p}@{first}'].get(p)}" for p in ("torch", "optax")
                    if f"{p}@{first}" in meta)
          + (f"; not installed: {', '.join(missing)}" if missing else ""))
    print()
    print("3. one window (N accumulate steps + one Adam step), per library and thread count")
    hdr = f"{'threads':>7} " + " ".join(f"{c + ' ms':>18}" for c in names) + "".join(
        f" {'ours/' + p:>19}" for p in peers)
    print(hdr)
    print("-" * len(hdr))
    verdicts = []
    for t in args.thread_counts:
        key = {c: f"{c}@{t}/window" for c in names}
        row = f"{t:>7} " + " ".join(f"{med[key[c]]:18.3f}" for c in names)
        row += "".join(f" {med[key['ours']] / med[key[p]]:19.3f}" for p in peers)
        print(row)
        for label, group in (("torch", ["torch"]), ("optax", optaxes)):
            if group and group[0] in peers:
                fastest = min(med[key[p]] for p in group)
                verdicts.append((f"3 ours / {label}, {dtype}, {t} thread(s)",
                                 med[key["ours"]] / fastest, 1.0))
    print()
    print("   per call: an accumulating call (calls 1..N-1 of a window; optax: a MultiSteps "
          "call that does not step) and the window's last call (ours: accumulate + apply; "
          "torch: backward + step + zero_grad; optax: the stepping call), ms")
    print(f"{'threads':>7} " + " ".join(f"{c + ' call/last':>26}" for c in names))
    for t in args.thread_counts:
        print(f"{t:>7} " + " ".join(f"{med[f'{c}@{t}/call']:15.3f}/{med[f'{c}@{t}/step']:<10.3f}"
                                    for c in names))
    print()
    print("4. Adam apply step against the copy bandwidth of a parameter-sized array "
          f"({m['param_bytes'] / 2**20:.2f} MB {dtype})")
    print(f"{'threads':>7} {'apply ms':>9} {'MB moved':>9} {'apply GB/s':>11} "
          f"{'copy ms':>8} {'copy GB/s':>10} {'ratio':>6}")
    for t in args.thread_counts:
        mm = meta[f"ours@{t}"]
        ap, cp = med[f"ours@{t}/apply"], med[f"ours@{t}/copy"]
        bw_a, bw_c = mm["apply_bytes"] / ap / 1e6, mm["copy_bytes"] / cp / 1e6
        print(f"{t:>7} {ap:9.3f} {mm['apply_bytes'] / 2**20:9.2f} {bw_a:11.2f} {cp:8.3f} "
              f"{bw_c:10.2f} {bw_a / bw_c:6.2f}")
    print()
    return verdicts


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="few rounds (smoke test)")
    ap.add_argument("--every", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--windows", type=int, default=None, help="windows per round and worker")
    ap.add_argument("--threads", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--thread-counts", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--dtypes", nargs="+", choices=["float32", "float64"],
                    default=["float32", "float64"])
    ap.add_argument("--dtype", default="float32", help=argparse.SUPPRESS)
    ap.add_argument("--max-seconds", type=float, default=None)
    ap.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.rounds = args.rounds or (2 if args.quick else 15)
    args.windows = args.windows or (3 if args.quick else 10)
    args.max_seconds = args.max_seconds or (20 if args.quick else 240)
    if args.worker:
        proto = worker_io()
        args.cpus = pin_cpus(args.threads)
        WORKERS[args.worker](args, proto)
    else:
        parent_main(args)


if __name__ == "__main__":
    main()
