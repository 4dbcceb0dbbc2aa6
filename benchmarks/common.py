"""The one benchmark harness: model, data, timing and worker processes.

Every script under ``benchmarks/`` (``distributed.py`` aside) builds on this:

* **Model.** :func:`init_params` draws the 784-512-10 ReLU MLP's initial
  values once; :func:`mlp` (PyTensor), :func:`torch_mlp` and :func:`jax_mlp`
  build the same network, mean cross-entropy loss, from those same values,
  and :func:`batch` the same batch of 64.
* **The timed code.** :func:`trainer` compiles the library's own two
  functions on that model (``lasagne_accum.compile_accumulation`` with
  ``lasagne_accum.adam``), in the library's default modes or a given one;
  :func:`torch_loop` is PyTorch's own accumulation loop on the same values
  (``loss.backward()`` into ``.grad``, ``torch.optim.Adam``);
  :func:`inplace_writes` lists what a compiled function writes in place.
* **Timing.** :func:`per_call` (per-call wall times), :func:`time_calls`
  (mean or median of back-to-back calls, after a warm-up),
  :func:`time_windows` (accumulate and apply calls of windows of N batches,
  each call timed), :func:`step_windows` (two trainers' windows, alternating, and
  their ratio), :func:`median`.
* **Workers.** Each library (and each thread setting) runs in its own
  process, started by :class:`Worker` with the thread count pinned (the
  thread variables of OpenBLAS, OpenMP, MKL, Numba, XLA and the CPU
  affinity); the parent asks the workers in turn, round after round
  (:func:`interleaved_rounds`, the order rotating), so that the load of other
  processes hits them all alike. A worker answers with :func:`serve`;
  :func:`run_workers` does the parent's whole part (start, wait until ready,
  rounds, close; the workers' log tail on a failure).
* **Context.** :func:`load_average` (this machine is shared: the line says so),
  :func:`openblas_threads`, :func:`available_modes`.

Not a test: the scripts print ratio tables measured side by side in one run
(interleaved rounds, medians); timings are never asserted.
"""

from __future__ import annotations

import contextlib
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
LR = 1e-3  # Adam's learning rate in every script
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


def trainer(dtype="float32", every=1, mode=None, apply_mode=None, lr=LR):
    """The library's own two functions on :func:`mlp`, Adam (learning rate `lr`).

    ``lasagne_accum.compile_accumulation`` with ``lasagne_accum.adam``: the
    accumulate function (inputs ``x, y``, returns the loss) and the apply
    function (the rule on the accumulated mean gradients, guarded, plus the
    reset), in the library's default modes unless `mode` / `apply_mode` are
    given (`mode` alone: both).

    Returns
    -------
    ((x, y), params, loss, trainer)
    """
    import lasagne_accum as la

    (x, y), params, loss = mlp(dtype)
    tr = la.compile_accumulation([x, y], loss, params, la.adam, dict(learning_rate=lr),
                                 every=every, mode=mode, apply_mode=apply_mode)
    return (x, y), params, loss, tr


def torch_loop(dtype="float32", lr=LR):
    """PyTorch's own accumulation loop on :func:`torch_mlp` and :func:`batch`.

    Returns a namespace: ``params``, ``opt`` (``torch.optim.Adam``, PyTorch's
    defaults but `lr`), ``fwd_bwd()`` (``torch.autograd.grad`` of the loss),
    ``accumulate()`` (``loss.backward()``: adds into ``.grad``, no
    ``zero_grad``; returns the loss) and ``apply()`` (``opt.step()`` then
    ``opt.zero_grad()``). Every ``.grad`` exists on return.
    """
    import types

    import torch

    params, loss_fn = torch_mlp(dtype)
    xv, yv = batch(dtype)
    x, y = torch.from_numpy(xv), torch.from_numpy(yv)
    opt = torch.optim.Adam(params, lr=lr)

    def fwd_bwd():
        return torch.autograd.grad(loss_fn(params, x, y), params)

    def accumulate():
        loss = loss_fn(params, x, y)
        loss.backward()
        return loss.detach()

    def apply():
        opt.step()
        opt.zero_grad()  # PyTorch's default: set_to_none=True

    accumulate()
    return types.SimpleNamespace(params=params, opt=opt, fwd_bwd=fwd_bwd,
                                 accumulate=accumulate, apply=apply)


def set_torch_threads(threads=0):
    """Set PyTorch's intra-op threads to `threads`, else to the system OpenBLAS's count.

    The second matches PyTensor's C BLAS, so that the libraries compete with
    equal thread counts. Returns the count PyTorch reports.
    """
    import torch

    torch.set_num_threads(threads or openblas_threads().get("system_openblas")
                          or os.cpu_count())
    return torch.get_num_threads()


def inplace_writes(fn, variables):
    """``{name: [op, ...]}``: the nodes of compiled `fn` that write `variables` in place.

    A node writes an input in place when its op's ``destroy_map`` names it
    (``Gemm{inplace}`` accumulating into a buffer, an elementwise op
    updating a parameter); `variables` are shared variables of `fn`.
    """
    fg = fn.maker.fgraph
    ids = {id(v) for v in variables}
    by_input = {fg.inputs[k]: i.variable.name for k, i in enumerate(fn.maker.inputs)
                if id(i.variable) in ids}
    out = {name: [] for name in by_input.values()}
    for node in fg.toposort():
        for destroyed in getattr(node.op, "destroy_map", {}).values():
            for j in destroyed:
                if node.inputs[j] in by_input:
                    op = str(node.op)
                    out[by_input[node.inputs[j]]].append(
                        op.split("{")[0] + ("{inplace}" if "Gemm" in op else "(inplace)"))
    return out


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


def time_calls(fn, args=(), repeat=50, *, warmup=0, stat="mean"):
    """Seconds per call of ``fn(*args)`` over `repeat` back-to-back calls.

    After `warmup` untimed calls. ``stat="mean"``: one clock around the loop;
    ``stat="median"``: the median of the calls' own times, which keeps an
    occasional preemption on a shared machine out of the number.
    """
    for _ in range(warmup):
        fn(*args)
    if stat == "median":
        return median(per_call(fn, repeat, args))
    if stat != "mean":
        raise ValueError(f"stat must be 'mean' or 'median', got {stat!r}")
    start = time.perf_counter()
    for _ in range(repeat):
        fn(*args)
    return (time.perf_counter() - start) / repeat


def time_windows(accumulate, apply, every, windows, args=()):
    """Times (s) of each ``accumulate(*args)`` and each ``apply()`` call.

    `windows` windows of `every` accumulate calls and one apply call each;
    returns ``(accumulate_times, apply_times)``.
    """
    clock = time.perf_counter
    acc_t, apply_t = [], []
    for _ in range(windows):
        for _ in range(every):
            t0 = clock()
            accumulate(*args)
            acc_t.append(clock() - t0)
        t0 = clock()
        apply()
        apply_t.append(clock() - t0)
    return acc_t, apply_t


def step_windows(trainers, data, every, windows, warmup=3):
    """Time windows of `every` ``trainer.step(*data)`` calls of two trainers, alternating.

    `trainers` is ``{name: trainer}`` with two entries, ``(a, b)`` in order. Warm-up windows
    first (JIT compilation); then `windows` windows of each, the order swapped every
    window. Returns ``measure(r)`` for :func:`serve`: the median window of each (seconds)
    and ``"ratio"``, the median of ``a / b`` over neighbouring windows.
    """
    clock = time.perf_counter
    a, b = trainers

    def window(trainer):
        start = clock()
        for _ in range(every):
            trainer.step(*data)
        return clock() - start

    for _ in range(warmup):
        for trainer in trainers.values():
            window(trainer)

    def measure(r):
        t = {a: [], b: []}
        for i in range(windows):
            for name in ((b, a) if i % 2 else (a, b)):
                t[name].append(window(trainers[name]))
        out = {n: median(v) for n, v in t.items()}
        out["ratio"] = median(x / y for x, y in zip(t[a], t[b]))
        return out

    return measure


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
        Where the worker's stderr goes (None: the parent's).
    env : dict
        The environment to start from (default ``os.environ``).
    label : str
        The worker's name in results (default `name`).
    """

    def __init__(self, script, name, args=(), threads=0, log=None, env=None, label=None):
        self.name = label or name
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


def worker_log(prefix):
    """A temporary file for the workers' stderr (kept: its name is printed)."""
    import tempfile

    return tempfile.NamedTemporaryFile("w+", prefix=f"{prefix}-", suffix=".log", delete=False)


@contextlib.contextmanager
def started_workers(workers, log=None, one_at_a_time=False):
    """Start workers and yield them; print the end of `log` if one fails; close them all.

    `workers`, `log` and `one_at_a_time` are as in :func:`run_workers`.
    """
    started = []
    try:
        for kwargs in workers:
            started.append(Worker(log=log, **kwargs))
            if one_at_a_time:
                started[-1].ready()
        yield started
    except RuntimeError:
        if log is not None and hasattr(log, "seek"):
            log.flush()
            log.seek(0)
            sys.stderr.write(log.read()[-5000:])
        raise
    finally:
        for w in started:
            w.close()


def run_workers(workers, rounds, max_seconds=None, log=None, one_at_a_time=False):
    """The parent's part: start workers, wait until ready, interleaved rounds, close.

    Parameters
    ----------
    workers : list of dict
        :class:`Worker` keyword arguments (``script``, ``name``, ``args``,
        ``threads``, ``env``, ``label``), one per worker.
    rounds, max_seconds
        As in :func:`interleaved_rounds`.
    log : file
        The workers' stderr; its last lines are printed if one exits early.
    one_at_a_time : bool
        Start the next worker only when the previous one is ready, so that
        compilation times (in the metadata) are not measured under each
        other's load.

    Returns
    -------
    (meta, samples)
        ``{name: ready metadata}`` and :func:`interleaved_rounds`' samples.
    """
    with started_workers(workers, log, one_at_a_time) as started:
        meta = {w.name: w.meta if w.meta is not None else w.ready() for w in started}
        samples = interleaved_rounds(started, rounds, max_seconds)
    return meta, samples
