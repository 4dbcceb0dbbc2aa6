"""The measurement behind :func:`lasagne_accum.default_modes`, run in a process of its own.

``python -m lasagne_accum._probe`` reads a JSON request, one line on standard
input (``{"dtypes": [...], "blas__ldflags": ..., "handshake": false}``), and
writes one JSON answer on standard output: for each dtype, milliseconds per call of an accumulate step
and an apply step compiled under C and under Numba (through
:func:`lasagne_accum.mode`, as the library compiles them), and the BLAS
libraries the process loaded before and after the C step first ran (the C
backend's own BLAS is the difference). A process of its own, so that the
measurement sees neither the caller's compiled functions nor its test-suite
patches of PyTensor's mode names, and so that the BLAS the C backend loads
can be told from NumPy's and SciPy's.

With ``"handshake": true`` the probe compiles everything first, writes the line
``compiled`` and waits for a line on standard input before it times anything:
the caller compiles the probes of several dtypes in parallel processes and has
them time one after another, each on a quiet machine.

The two steps are small versions of what :func:`compile_accumulation`
compiles: the accumulate step is two dense layers' forward pass and their
weight gradients added into buffers (the matrix products of a forward and a
backward pass, each weight gradient a ``Gemm`` into its buffer); the apply
step is :func:`lasagne_accum.adam` on those buffers and their reset. Each
backend runs in blocks of calls, the blocks alternating with a pause between
them (a BLAS's idle threads spin for a while and would slow the other BLAS's
threads); the medians decide.
"""

from __future__ import annotations

import json
import os
import sys
import time

#: batch, inputs, units of the probe's two dense layers
SHAPE = (128, 512, 512)
ROUNDS = 15
CALLS = 5
#: each backend is timed in this many blocks of ROUNDS x CALLS calls, the blocks alternating
BLOCKS = 2
#: seconds between blocks: a BLAS's idle threads spin for a while after their last call and
#: would take the cores from the other backend's BLAS threads
PAUSE = 0.25
BACKENDS = ("CVM", "NUMBA")
STEPS = ("accumulate", "apply")


def libraries():
    """The BLAS and OpenMP libraries this process has loaded (threadpoolctl), or None."""
    try:
        from threadpoolctl import threadpool_info  # type: ignore[import-untyped]
    except ImportError:
        return None
    keys = ("user_api", "internal_api", "prefix", "filepath", "version", "architecture",
            "threading_layer", "num_threads")
    return [{k: info.get(k) for k in keys} for info in threadpool_info()]


def _steps(dtype):
    """The probe's accumulate and apply updates: ``(inputs, updates)`` for each step."""
    import numpy as np
    import pytensor
    import pytensor.tensor as pt

    import lasagne_accum as la

    batch, n_in, n_out = SHAPE
    rng = np.random.default_rng(0)
    Ws = [pytensor.shared((rng.normal(size=shape) * 0.05).astype(dtype), name=f"W{i}")
          for i, shape in enumerate([(n_in, n_out), (n_out, n_out)])]
    accs = [pytensor.shared(np.zeros_like(W.get_value()), name=f"{W.name}.grad_accu")
            for W in Ws]
    x = pt.matrix("x", dtype=dtype)
    loss = pt.sqr(pt.maximum(x @ Ws[0], 0) @ Ws[1]).sum() / batch
    accumulate = {a: a + g for a, g in zip(accs, pytensor.grad(loss, Ws))}
    apply = la.merge_updates(la.adam(accs, Ws, 1e-3, name="probe"), la.reset(accs))
    return {"accumulate": ([x], accumulate), "apply": ([], apply)}, \
        rng.random((batch, n_in)).astype(dtype)


def _per_call(fn, args):
    start = time.perf_counter()
    for _ in range(CALLS):
        fn(*args)
    return (time.perf_counter() - start) / CALLS


def compile_steps(dtype):
    """Each step compiled under each backend and called three times: ``{step: (fns,
    errors, args)}``, ``fns`` by backend and ``errors`` for a backend that failed to
    compile (the other backend then wins)."""
    import pytensor

    import lasagne_accum as la

    steps, x = _steps(dtype)
    compiled = {}
    for step in STEPS:
        inputs, updates = steps[step]
        args = (x,) if inputs else ()
        fns, errors = {}, {}
        for backend in BACKENDS:
            try:
                fn = pytensor.function(inputs, [], updates=updates, mode=la.mode(backend))
                for _ in range(3):
                    fn(*args)
                fns[backend] = fn
            except Exception as exc:  # a missing compiler, a Numba failure: the other wins
                errors[backend] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        compiled[step] = (fns, errors, args)
    return compiled


def time_steps(compiled):
    """``{step: {"CVM": ms, "NUMBA": ms}}`` (medians), plus an ``"error"`` per backend
    that failed to compile."""
    import statistics

    result = {}
    for step in STEPS:
        fns, errors, args = compiled[step]
        times = {b: [] for b in fns}
        for _ in range(BLOCKS):
            for backend, fn in fns.items():
                time.sleep(PAUSE)
                fn(*args)
                times[backend] += [_per_call(fn, args) for _ in range(ROUNDS)]
        entry = {b: 1000 * statistics.median(t) for b, t in times.items()}
        if errors:
            entry["error"] = errors
        result[step] = entry
    return result


def _roles(before, after):
    """`after`'s BLAS libraries, each with the backend it serves: a library that was not
    loaded before the C step first ran is the C backend's own."""
    if after is None:
        return []
    before_paths = {lib["filepath"] for lib in before or []}
    out = []
    for lib in after:
        if lib["user_api"] != "blas":
            continue
        path = str(lib["filepath"])
        role = ("C backend" if path not in before_paths else "NumPy" if "numpy" in path
                else "SciPy (Numba's dot)" if "scipy" in path else "another library")
        out.append(dict(lib, role=role))
    return out


def main():
    request = json.loads(sys.stdin.readline())
    import numpy  # noqa: F401  NumPy's BLAS
    import pytensor
    import scipy.linalg.cython_blas  # noqa: F401  SciPy's BLAS: what Numba's dot calls

    if request.get("blas__ldflags") is not None:
        pytensor.config.blas__ldflags = request["blas__ldflags"]
    before = libraries()
    answer = {"dtypes": {}, "load": os.getloadavg()[0] if hasattr(os, "getloadavg") else None}
    compiled = {dtype: compile_steps(dtype) for dtype in request["dtypes"]}
    # the C step of the first dtype has loaded the C backend's BLAS
    answer["libraries"] = _roles(before, libraries())
    if request.get("handshake"):
        print("compiled", flush=True)
        sys.stdin.readline()
    for dtype in request["dtypes"]:
        answer["dtypes"][dtype] = time_steps(compiled[dtype])
    json.dump(answer, sys.stdout)


if __name__ == "__main__":
    main()
