"""The one benchmark harness: model, data, timing and worker processes.

Every script under ``benchmarks/`` (``distributed.py`` aside) builds on this:

* **Model.** :func:`init_params` draws the 784-512-10 ReLU MLP's initial
  values once; :func:`mlp` (PyTensor), :func:`torch_mlp` and :func:`jax_mlp`
  build the same network, mean cross-entropy loss, from those same values,
  and :func:`batch` the same batch of 64.
* **Timing.** :func:`per_call` (per-call wall times), :func:`time_calls`
  (mean of back-to-back calls), :func:`median`.
* **Workers.** Each library (and each thread setting) runs in its own
  process, started by :class:`Worker` with the thread count pinned (the
  thread variables of OpenBLAS, OpenMP, MKL, Numba, XLA and the CPU
  affinity); the parent asks the workers in turn, round after round
  (:func:`interleaved_rounds`, the order rotating), so that the load of other
  processes hits them all alike. A worker answers with :func:`serve`.
* **Context.** :func:`load_average` (this machine is shared: the line says so),
  :func:`openblas_threads`, :func:`available_modes`.

Not a test: the scripts print ratio tables measured side by side in one run
(interleaved rounds, medians); timings are never asserted.
"""

from __future__ import annotations

import ctypes
import glob
import json
import os
import statistics
import subprocess
import sys
import time

SIZES = (784, 512, 10)
BATCH = 64
PROTO = "@@BENCH "  # prefix of the protocol lines on a worker's stdout
THREAD_VARS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS",
               "NUMBA_NUM_THREADS")


# --------------------------------------------------------------------------
# one model for every library
# --------------------------------------------------------------------------
def init_params(dtype="float32", sizes=SIZES, seed=0):
    """Initial values ``[W1, b1, W2, b2]`` (numpy) of the ReLU MLP."""
    import numpy as np

    rng = np.random.RandomState(seed)
    n_in, n_hidden, n_out = sizes
    return [(rng.randn(n_in, n_hidden) * 0.05).astype(dtype), np.zeros(n_hidden, dtype),
            (rng.randn(n_hidden, n_out) * 0.05).astype(dtype), np.zeros(n_out, dtype)]


def batch(dtype="float32", size=BATCH, sizes=SIZES, seed=1):
    """One batch ``(x, y)``: uniform inputs, int64 class labels."""
    import numpy as np

    rng = np.random.RandomState(seed)
    return (rng.rand(size, sizes[0]).astype(dtype),
            rng.randint(0, sizes[2], size=size).astype("int64"))


def mlp(dtype="float32", sizes=SIZES, seed=0):
    """PyTensor: inputs (x, y), shared params [W1, b1, W2, b2], mean cross-entropy loss."""
    import pytensor
    import pytensor.tensor as pt

    W1, b1, W2, b2 = (pytensor.shared(v, name=n) for v, n in
                      zip(init_params(dtype, sizes, seed), ("W1", "b1", "W2", "b2")))
    x = pt.matrix("x", dtype=dtype)
    y = pt.vector("y", dtype="int64")
    hidden = pt.maximum(x @ W1 + b1, 0)
    logits = hidden @ W2 + b2
    log_probs = logits - pt.logsumexp(logits, axis=1, keepdims=True)
    loss = -log_probs[pt.arange(y.shape[0]), y].mean()
    return (x, y), [W1, b1, W2, b2], loss


def torch_mlp(dtype="float32", sizes=SIZES, seed=0):
    """PyTorch: ``(params, loss_fn)`` with ``loss_fn(params, x, y)``, the same network."""
    import torch

    params = [torch.tensor(v, requires_grad=True) for v in init_params(dtype, sizes, seed)]

    def loss_fn(params, x, y):
        W1, b1, W2, b2 = params
        return torch.nn.functional.cross_entropy(torch.relu(x @ W1 + b1) @ W2 + b2, y)

    return params, loss_fn


def jax_mlp(dtype="float32", sizes=SIZES, seed=0):
    """JAX: ``(params, loss_fn)`` with ``loss_fn(params, x, y)``, the same network."""
    import jax.numpy as jnp

    params = [jnp.asarray(v) for v in init_params(dtype, sizes, seed)]

    def loss_fn(params, x, y):
        W1, b1, W2, b2 = params
        logits = jnp.maximum(x @ W1 + b1, 0) @ W2 + b2
        log_probs = logits - jnp.max(logits, axis=1, keepdims=True)
        log_probs = log_probs - jnp.log(jnp.sum(jnp.exp(log_probs), axis=1, keepdims=True))
        return -jnp.mean(jnp.take_along_axis(log_probs, y[:, None], axis=1))

    return params, loss_fn


# --------------------------------------------------------------------------
# timing
# --------------------------------------------------------------------------
def per_call(fn, n, args=()):
    """Wall times (s) of `n` back-to-back calls of ``fn(*args)``."""
    clock = time.perf_counter
    out = [0.0] * n
    for i in range(n):
        t0 = clock()
        fn(*args)
        out[i] = clock() - t0
    return out


def time_calls(fn, args=(), repeat=50):
    """Seconds per call of ``fn(*args)``, the mean over `repeat` back-to-back calls."""
    start = time.perf_counter()
    for _ in range(repeat):
        fn(*args)
    return (time.perf_counter() - start) / repeat


def median(values):
    values = list(values)
    return float(statistics.median(values)) if values else float("nan")


# --------------------------------------------------------------------------
# context
# --------------------------------------------------------------------------
def load_average():
    """A line with the load average; this machine is shared with other processes."""
    one, five, fifteen = os.getloadavg()
    return (f"load average {one:.2f} / {five:.2f} / {fifteen:.2f} (1/5/15 min) on "
            f"{os.cpu_count()} CPUs; the machine is shared with other processes, so absolute "
            "times are noisy: compare the ratios, measured side by side")


def openblas_threads():
    """Thread counts of the system OpenBLAS (PyTensor's C BLAS) and NumPy's/SciPy's."""
    out = {}
    try:
        out["system_openblas"] = ctypes.CDLL("libopenblas.so.0").openblas_get_num_threads()
    except (OSError, AttributeError):
        out["system_openblas"] = None
    try:
        import numpy as np

        libdir = os.path.join(os.path.dirname(os.path.dirname(np.__file__)), "numpy.libs")
        for path in glob.glob(os.path.join(libdir, "libscipy_openblas*.so*")):
            lib = ctypes.CDLL(path)
            for fn in ("scipy_openblas_get_num_threads64_", "scipy_openblas_get_num_threads"):
                if hasattr(lib, fn):
                    out["numpy_openblas"] = getattr(lib, fn)()
                    break
    except OSError:
        pass
    return out


def available_modes():
    """Compilation modes installed here: C (with or without BLAS), Numba, JAX, PyTorch."""
    import importlib.util

    modes = ["CVM", "NUMBA"]
    for mode, module in (("JAX", "jax"), ("PYTORCH", "torch")):
        if importlib.util.find_spec(module) is not None:
            modes.append(mode)
    return modes


def have_module(name):
    """True if `name` imports in a fresh interpreter (a broken install counts as missing)."""
    return subprocess.run([sys.executable, "-c", f"import {name}"],
                          capture_output=True).returncode == 0


# --------------------------------------------------------------------------
# worker processes
# --------------------------------------------------------------------------
def thread_env(threads, env=None):
    """Environment pinning every library's thread pool to `threads` (0: unchanged)."""
    env = dict(os.environ if env is None else env)
    # idle OpenMP threads sleep instead of spinning: the workers take turns on the CPUs
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    if threads:
        for var in THREAD_VARS:
            env[var] = str(threads)
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen="
                            + ("false" if threads == 1 else "true")
                            + f" intra_op_parallelism_threads={threads}").strip()
    return env


def pin_cpus(threads):
    """Restrict this process to `threads` CPUs (0: all); returns the CPUs used."""
    cpus = sorted(os.sched_getaffinity(0))
    if threads and threads < len(cpus):
        cpus = cpus[:threads]
        os.sched_setaffinity(0, cpus)
    return cpus


class Worker:
    """A benchmark worker: ``python script --worker NAME ...`` in its own process.

    Parameters
    ----------
    script : str
        Path of the script; it must call :func:`serve` when given ``--worker``.
    name : str
        Passed as ``--worker NAME``.
    args : list of str
        More command-line arguments.
    threads : int
        Thread count pinned through :func:`thread_env` (0: library defaults).
    log : file
        Where the worker's stderr goes.
    """

    def __init__(self, script, name, args=(), threads=0, log=None, env=None):
        self.name = name
        cmd = [sys.executable, script, "--worker", name, "--threads", str(threads), *args]
        self.proc = subprocess.Popen(cmd, env=thread_env(threads, env), stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=log, text=True, bufsize=1)
        self.meta = None

    def read(self):
        return read_proto(self.proc, self.name)

    def ready(self):
        """Wait until the worker has compiled and warmed up; returns its metadata."""
        self.meta = self.read()["ready"]
        return self.meta

    def run(self, r):
        """One round: the worker's ``{key: seconds}``."""
        self.proc.stdin.write(f"run {r}\n")
        return self.read()["result"]

    def close(self):
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait()


def read_proto(proc, name="worker"):
    """The next protocol message from a worker process's stdout."""
    while True:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{name} exited early (rc={proc.wait()}); see its log")
        if line.startswith(PROTO):
            return json.loads(line[len(PROTO):])


def worker_io():
    """Keep the protocol channel clean of library chatter: fd 1 goes to stderr."""
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return proto


def serve(proto, meta, measure):
    """Worker side: send `meta`, then answer each ``run r`` with ``measure(r)``.

    `proto` is the channel :func:`worker_io` returned (call it first thing).
    """
    proto.write(PROTO + json.dumps({"ready": meta}) + "\n")
    for line in sys.stdin:
        if not line.startswith("run"):
            break
        proto.write(PROTO + json.dumps({"result": measure(int(line.split()[1]))}) + "\n")


def interleaved_rounds(workers, rounds, max_seconds=None):
    """Ask every worker in turn, `rounds` times (order rotating); ``{key: [s, ...]}``.

    Keys are prefixed with the worker's name (``"torch/acc"``). Stops starting
    rounds (after two) once `max_seconds` have passed.
    """
    samples = {}
    start = time.perf_counter()
    for r in range(rounds):
        if max_seconds and r >= 2 and time.perf_counter() - start > max_seconds:
            print(f"(stopped after {r} rounds: --max-seconds {max_seconds:.0f} reached)")
            break
        order = workers[r % len(workers):] + workers[:r % len(workers)]
        for w in order:
            for k, v in w.run(r).items():
                samples.setdefault(f"{w.name}/{k}", []).append(v)
    return samples
