"""An effective batch of 4096 in B x N: time per window and peak memory, JAX and PyTorch.

For two models of ``examples/models.py``, the digits CNN (im2col convolution,
2x2 max-pooling, dense layers) and a wide MLP (one hidden layer of
``--hidden`` units, 4096 by default), trained with momentum SGD (learning
rate ``--lr``, momentum 0.9) on windows of ``--effective`` digits (4096, drawn
with replacement; the same draws everywhere) split into N micro-batches of
``--batch`` examples, side by side in one run:

* ``la-jax``     -- ``lasagne_accum.compile_accumulation(..., mode="JAX")``:
  the two functions, state donated (``lasagne_accum.mode("JAX")``);
* ``optax``      -- optax's ``MultiSteps(sgd(lr, momentum))`` under
  ``jax.jit`` with the parameters and optimizer state donated, one call per
  micro-batch;
* ``la-torch``   -- ``compile_accumulation(..., mode=lasagne_accum.mode(
  "PYTORCH", device=...))``: state as torch tensors on the device;
* ``torch-loop`` -- PyTorch's own accumulation loop on the same device
  (``(loss / N).backward()`` into ``.grad``, ``torch.optim.SGD`` every N);
* ``c``          -- ``compile_accumulation(..., mode="CVM")``: the reference
  the others' final parameters are compared with (it is timed too).

The JAX and PyTorch models are written here with the semantics of the
PyTensor graph's gradient where it has a choice (a ReLU at exactly 0 passes
the gradient; a max-pool tie gives every tied input the whole gradient), so
that all five compute the same numbers up to rounding.

Each configuration runs in its own process (``common.Worker``): it compiles
and runs one window, then the parent asks them in turn, round after round
(``--rounds``, the order rotating), to time one window (until the new state
exists: JAX and CUDA run asynchronously). A last window measures the peak
memory: on a GPU, the allocator's peak (``torch.cuda.max_memory_allocated``,
JAX's ``peak_bytes_in_use``); on the CPU, for JAX, what XLA's memory analysis
of the compiled steps says (resident state plus the largest transient need:
``lasagne_accum.step_memory``, and ``memory_analysis()`` of optax's jitted
step), and for PyTorch and C, the bytes of the arrays resident before the
window plus the growth of the process's resident set during it
(``/proc/self/status``, high-water mark reset first: a rough figure, the C
library's allocator keeps memory it has freed). The "measured by" column says
which. The agreement check compares the parameters after the first 3
windows (float32: those of the timed run; float64: a second run of the same
windows) with the C backend's, as the largest difference relative to each
parameter's largest magnitude (targets: 1e-10 in float64, 1e-5 in float32).
Every configuration sees the same windows in the same order.

PyTorch runs on CUDA when torch sees a GPU (``--device``), JAX on its default
backend. Without a GPU every figure is a CPU figure, and the script says so:
no GPU number is printed that was not measured on a GPU.

    python benchmarks/gpu.py                 # both models, about 10 minutes on 2 CPUs
    python benchmarks/gpu.py --quick         # smoke test: small windows, 2 rounds
    python benchmarks/gpu.py --models mlp --batch 1024
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

HERE = os.path.abspath(__file__)
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "examples"))

from common import interleaved_rounds, load_average, median, serve, started_workers, \
    worker_io, worker_log  # noqa: E402  (no heavy imports)

CONFIGS = ("la-jax", "optax", "la-torch", "torch-loop", "c")
MODELS = ("cnn", "mlp")
MOMENTUM = 0.9
AGREEMENT_WINDOWS = 3


# --------------------------------------------------------------------------
# data: the same windows in every process
# --------------------------------------------------------------------------
def digits(dtype):
    import models

    (X, y, _, _), side = models.load_data_or_exit(0, dtype=dtype)
    return X, y, side


def window_batches(X, y, w, effective, batch):
    """Window `w`: `effective` examples drawn with replacement, in micro-batches."""
    import numpy as np

    index = np.random.RandomState(1000 + w).randint(0, len(X), size=effective)
    return [(X[index[k:k + batch]], y[index[k:k + batch]])
            for k in range(0, effective, batch)]


# --------------------------------------------------------------------------
# the models, for PyTensor (examples/models.py) and written out for JAX and torch
# --------------------------------------------------------------------------
def pytensor_model(kind, dtype, hidden, side):
    import models

    sizes = {"n_hidden": hidden} if kind == "mlp" else {}
    return models.build_model(kind, side, seed=0, dtype=dtype, **sizes)


def im2col_index(side, k=3):
    """models.conv2d's gather index: the k*k pixels under the filter, per position."""
    import numpy as np

    ho = wo = side - k + 1
    rows = np.arange(ho)[:, None, None, None] + np.arange(k)[None, None, :, None]
    cols = np.arange(wo)[None, :, None, None] + np.arange(k)[None, None, None, :]
    return (rows * side + cols).reshape(-1), ho


def jax_loss(kind, side):
    """``loss(params, x, y)`` of the model in JAX, the PyTensor graph's gradient semantics."""
    import jax
    import jax.numpy as jnp

    def relu(z):           # maximum(z, 0): the gradient passes at z == 0, as in PyTensor
        return z * (z >= 0).astype(z.dtype)

    @jax.custom_vjp
    def pool(maps):        # 2x2 max-pool of (B, h, 2, w, 2, F)
        return maps.max(axis=(2, 4))

    def pool_fwd(maps):
        out = maps.max(axis=(2, 4))
        return out, (maps, out)

    def pool_bwd(res, g):  # every tied input gets the whole gradient, as in PyTensor
        maps, out = res
        hit = maps == out[:, :, None, :, None, :]
        return (hit.astype(g.dtype) * g[:, :, None, :, None, :],)

    pool.defvjp(pool_fwd, pool_bwd)

    def logits_of(params, x):
        if kind == "mlp":
            W1, b1, W2, b2 = params
            return relu(x @ W1 + b1) @ W2 + b2
        Wc, bc, W1, b1, W2, b2 = params
        index, ho = im2col_index(side)
        n, filters = x.shape[0], Wc.shape[1]
        patches = x.reshape(n, side * side, 1)[:, index, :].reshape(n * ho * ho, -1)
        maps = relu(patches @ Wc + bc).reshape(n, ho, ho, filters)
        h = ho // 2
        pooled = pool(maps[:, :2 * h, :2 * h, :].reshape(n, h, 2, h, 2, filters))
        return relu(pooled.reshape(n, -1) @ W1 + b1) @ W2 + b2

    def loss(params, x, y):
        logits = logits_of(params, x)
        log_probs = logits - jax.scipy.special.logsumexp(logits, axis=1, keepdims=True)
        return -jnp.mean(jnp.take_along_axis(log_probs, y[:, None], axis=1))

    return loss


def torch_loss(kind, side, device):
    """``loss(params, x, y)`` in PyTorch, with the same gradient semantics."""
    import torch

    def relu(z):
        return z * (z >= 0).to(z.dtype)

    class Pool(torch.autograd.Function):
        @staticmethod
        def forward(ctx, maps):
            out = maps.amax(dim=(2, 4))
            ctx.save_for_backward(maps, out)
            return out

        @staticmethod
        def backward(ctx, g):
            maps, out = ctx.saved_tensors
            hit = maps == out[:, :, None, :, None, :]
            return hit.to(g.dtype) * g[:, :, None, :, None, :]

    index = None
    if kind == "cnn":
        flat, ho = im2col_index(side)
        index = torch.as_tensor(flat, device=device)

    def logits_of(params, x):
        if kind == "mlp":
            W1, b1, W2, b2 = params
            return relu(x @ W1 + b1) @ W2 + b2
        Wc, bc, W1, b1, W2, b2 = params
        n, filters = x.shape[0], Wc.shape[1]
        patches = x.reshape(n, side * side, 1)[:, index, :].reshape(n * ho * ho, -1)
        maps = relu(patches @ Wc + bc).reshape(n, ho, ho, filters)
        h = ho // 2
        pooled = Pool.apply(maps[:, :2 * h, :2 * h, :].reshape(n, h, 2, h, 2, filters))
        return relu(pooled.reshape(n, -1) @ W1 + b1) @ W2 + b2

    def loss(params, x, y):
        logits = logits_of(params, x)
        log_probs = logits - torch.logsumexp(logits, dim=1, keepdim=True)
        return -log_probs.gather(1, y[:, None]).mean()

    return loss


# --------------------------------------------------------------------------
# one configuration: build, run a window, report
# --------------------------------------------------------------------------
class Run:
    """One configuration on one model and dtype: ``window(w)``, ``sync()``, ``params()``."""

    def __init__(self, config, kind, dtype, args, device):
        import numpy as np

        self.X, self.y, side = digits(dtype)
        self.args, self.N = args, args.effective // args.batch
        self.config, self.device = config, device
        model = pytensor_model(kind, dtype, args.hidden, side)
        initial = [p.get_value() for p in model.params]
        start = time.perf_counter()
        if config in ("la-jax", "la-torch", "c"):
            import lasagne_accum as la

            mode = {"la-jax": "JAX", "c": "CVM"}.get(config) or la.mode("PYTORCH",
                                                                       device=device)
            self.trainer = la.compile_accumulation(
                [model.x, model.y], model.loss, model.params, la.momentum,
                dict(learning_rate=args.lr, momentum=MOMENTUM), every=self.N, mode=mode,
                outputs=[])
            self.shared = list(self.trainer.apply_updates)
            self.model_params = model.params
        elif config == "optax":
            import jax
            import jax.numpy as jnp
            import optax

            jax.config.update("jax_enable_x64", True)   # float64 is float64 (PyTensor's too)

            loss = jax_loss(kind, side)
            # the gradient mean in the model's dtype (optax's default accumulator is float32)
            self.opt = optax.MultiSteps(optax.sgd(args.lr, momentum=MOMENTUM),
                                        every_k_schedule=self.N, accumulator_dtype=dtype)
            self.jparams = [jnp.asarray(v) for v in initial]
            self.state = self.opt.init(self.jparams)

            def step(params, state, x, y):
                grads = jax.grad(loss)(params, x, y)
                updates, state = self.opt.update(grads, state, params)
                return optax.apply_updates(params, updates), state

            self.step = jax.jit(step, donate_argnums=(0, 1))
        else:   # torch-loop
            import torch

            loss = torch_loss(kind, side, device)
            self.tparams = [torch.tensor(np.array(v), device=device, requires_grad=True)
                            for v in initial]
            self.opt = torch.optim.SGD(self.tparams, lr=args.lr, momentum=MOMENTUM)
            self.loss = loss
        self.build_s = time.perf_counter() - start

    def window(self, w):
        batches = window_batches(self.X, self.y, w, self.args.effective, self.args.batch)
        if self.config == "optax":
            for x, y in batches:
                self.jparams, self.state = self.step(self.jparams, self.state, x, y)
        elif self.config == "torch-loop":
            import torch

            for x, y in batches:
                xt = torch.as_tensor(x, device=self.device)
                yt = torch.as_tensor(y, device=self.device)
                (self.loss(self.tparams, xt, yt) / self.N).backward()
            self.opt.step()
            self.opt.zero_grad()
        else:
            for x, y in batches:
                self.trainer.step(x, y)
        self.sync()

    def sync(self):
        """Wait until the window's results exist (JAX and CUDA return early)."""
        if self.config in ("optax", "la-jax"):
            import jax

            values = (self.jparams, self.state) if self.config == "optax" else [
                v.get_value(borrow=True) for v in self.shared]
            jax.block_until_ready(values)
        elif self.device is not None and str(self.device).startswith("cuda"):
            import torch

            torch.cuda.synchronize()

    def params(self):
        """Copies of the current parameters (later windows update them in place)."""
        import numpy as np

        if self.config == "optax":
            return [np.array(p) for p in self.jparams]
        if self.config == "torch-loop":
            return [p.detach().cpu().numpy().copy() for p in self.tparams]
        import models

        return [np.array(models.value(p)) for p in self.model_params]

    def resident_bytes(self):
        """Bytes of the arrays that live between windows (the CPU's peak starts there)."""
        import numpy as np

        if self.config in ("optax", "la-jax"):
            import jax

            return sum(a.nbytes for a in jax.live_arrays())
        if self.config == "torch-loop":
            tensors = list(self.tparams) + [t for s in self.opt.state.values()
                                            for t in s.values() if hasattr(t, "nbytes")]
            return sum(t.nbytes for t in tensors)
        return sum(np.asarray(self._host(v)).nbytes for v in self.shared)

    @staticmethod
    def _host(var):
        import models

        return models.value(var)


def _rss():
    with open("/proc/self/status") as f:
        fields = dict(line.split(":", 1) for line in f)
    return tuple(int(fields[k].split()[0]) * 1024 for k in ("VmRSS", "VmHWM"))


def xla_peak(run):
    """Resident state + the largest transient need of the compiled steps, from XLA."""
    import jax
    import numpy as np

    B = run.args.batch
    x, y = run.X[:B], run.y[:B]
    if run.config == "la-jax":
        import lasagne_accum as la

        steps = [la.step_memory(run.trainer.accumulate_fn, x, y),
                 la.step_memory(run.trainer.apply_fn)]
        resident = sum(np.asarray(run._host(v)).nbytes for v in run.shared)
        return resident + max(s.transient for s in steps)
    stats = run.step.lower(run.jparams, run.state, x, y).compile().memory_analysis()
    state_args = sum(a.nbytes for a in jax.tree_util.tree_leaves((run.jparams, run.state)))
    transient = (stats.argument_size_in_bytes - state_args + stats.output_size_in_bytes
                 - stats.alias_size_in_bytes + stats.temp_size_in_bytes)
    return state_args + transient


def peak_bytes(run, w):
    """Peak device memory of window `w`, and how it was measured (see the module notes)."""
    import gc

    device = run.device
    if run.config in ("la-torch", "torch-loop") and str(device).startswith("cuda"):
        import torch

        torch.cuda.reset_peak_memory_stats(device)
        run.window(w)
        return torch.cuda.max_memory_allocated(device), "cuda allocator"
    if run.config in ("optax", "la-jax"):
        import jax

        stats = jax.devices()[0].memory_stats()
        run.window(w)
        if stats and "peak_bytes_in_use" in stats:
            return jax.devices()[0].memory_stats()["peak_bytes_in_use"], "jax allocator"
        return xla_peak(run), "xla analysis"
    gc.collect()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    resident = run.resident_bytes()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _rss()[0]
    run.window(w)
    return resident + _rss()[1] - before, "cpu rss"


def worker_main(args):
    proto = worker_io()
    import numpy as np

    config, kind = args.worker.split(":")
    device = None
    if config in ("la-torch", "torch-loop"):
        import torch

        device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    run = Run(config, kind, "float32", args, device)
    start = time.perf_counter()
    run.window(0)
    meta = {"build_s": round(run.build_s, 2), "first_window_s": round(
        time.perf_counter() - start, 2), "device": describe_device(config, device)}
    counter = [1]
    final = {}

    def measure(r):
        w = counter[0]
        counter[0] += 1
        if r >= 0:
            t0 = time.perf_counter()
            run.window(w)
            seconds = time.perf_counter() - t0
            if w == AGREEMENT_WINDOWS - 1:   # the float32 parameters to compare with C's
                final["float32"] = run.params()
            return {"window": seconds}
        peak, how = peak_bytes(run, w)
        result = {"peak": float(peak), "how": how}
        for dtype in ("float32", "float64"):   # a fresh run of the same first windows
            if dtype in final:
                continue
            check = Run(config, kind, dtype, args, device)
            for w_check in range(AGREEMENT_WINDOWS):
                check.window(w_check)
            final[dtype] = check.params()
        path = os.path.join(args.out, f"{config}-{kind}.npz")
        np.savez(path, **{f"{d}_{i}": v for d, vs in final.items() for i, v in enumerate(vs)})
        result["params"] = path
        result["windows32"] = counter[0]
        return result

    serve(proto, meta, measure)


def describe_device(config, device):
    if config in ("optax", "la-jax"):
        import jax

        d = jax.devices()[0]
        return f"jax {d.platform}:{d.id}"
    if device is not None:
        import torch

        if device.type == "cuda":
            return f"torch {device} ({torch.cuda.get_device_name(device)})"
        return f"torch {device}"
    return "C (host)"


# --------------------------------------------------------------------------
# the parent
# --------------------------------------------------------------------------
def agreement(paths, config, kind):
    """Largest |param - C's| / max|C's param| over the parameters, per dtype."""
    import numpy as np

    got, want = np.load(paths[(config, kind)]), np.load(paths[("c", kind)])
    out = {}
    for dtype in ("float32", "float64"):
        worst = 0.0
        for key in want.files:
            if key.startswith(dtype):
                ref = want[key].astype("float64")
                scale = float(np.max(np.abs(ref))) or 1.0
                worst = max(worst, float(np.max(np.abs(got[key] - ref))) / scale)
        out[dtype] = worst
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="cnn,mlp", help="comma-separated: cnn, mlp")
    p.add_argument("--configs", default=",".join(CONFIGS),
                   help=f"comma-separated, of {', '.join(CONFIGS)} (c is needed for the "
                        "agreement check)")
    p.add_argument("--effective", type=int, default=4096, help="examples per optimizer step")
    p.add_argument("--batch", type=int, default=512, help="micro-batch B (N = effective / B)")
    p.add_argument("--hidden", type=int, default=4096, help="hidden units of the wide MLP")
    p.add_argument("--lr", type=float, default=0.05, help="learning rate")
    p.add_argument("--rounds", type=int, default=7, help="timed windows per configuration")
    p.add_argument("--device", default=None,
                   help="PyTorch device (default: cuda when available, else cpu)")
    p.add_argument("--quick", action="store_true",
                   help="smoke test: effective batch 512, B=128, MLP of 256 units, 2 rounds")
    p.add_argument("--threads", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.effective, args.batch, args.hidden, args.rounds = 512, 128, 256, 2
    if args.effective % args.batch:
        p.error(f"--batch {args.batch} does not divide --effective {args.effective}")
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.worker:
        return worker_main(args)
    models = [m for m in args.models.split(",") if m]
    configs = [c for c in args.configs.split(",") if c]
    out = tempfile.mkdtemp(prefix="bench-gpu-")
    log = worker_log("bench-gpu")
    common_args = ["--effective", str(args.effective), "--batch", str(args.batch),
                   "--hidden", str(args.hidden), "--lr", str(args.lr), "--out", out]
    if args.device:
        common_args += ["--device", args.device]
    N = args.effective // args.batch
    print(f"effective batch {args.effective} = B {args.batch} x N {N}; momentum SGD lr "
          f"{args.lr}; {args.rounds} timed windows each; MLP hidden {args.hidden}")
    print(load_average(), flush=True)
    table, paths, devices = [], {}, {}
    for kind in models:
        specs = [dict(script=HERE, name=f"{config}:{kind}", args=common_args, label=config)
                 for config in configs]
        # one at a time: compile times not under each other
        with started_workers(specs, log, one_at_a_time=True) as workers:
            devices.update((w.name, w.meta["device"]) for w in workers)
            samples = interleaved_rounds(workers, args.rounds)
            reports = {w.name: w.run(-1) for w in workers}
        for config in configs:
            paths[(config, kind)] = reports[config]["params"]
        for config in configs:
            row = dict(model=kind, config=config,
                       window=median(samples[f"{config}/window"]),
                       peak=reports[config]["peak"], how=reports[config]["how"])
            if "c" in configs:
                row.update(agreement(paths, config, kind))
            table.append(row)
    print_table(table, devices, args)
    return table


def print_table(table, devices, args):
    print("\ndevices: " + "; ".join(f"{c}: {d}" for c, d in devices.items()))
    on_gpu = any("cuda" in d or "gpu" in d for d in devices.values())
    print(f"\n{'model':<5} {'config':<10} {'ms/window':>10} {'peak MB':>9}  {'measured by':<14}"
          f" {'vs C f32':>9} {'vs C f64':>9}")
    for r in table:
        print(f"{r['model']:<5} {r['config']:<10} {1000 * r['window']:10.1f} "
              f"{r['peak'] / 1e6:9.1f}  {r['how']:<14} {r.get('float32', float('nan')):9.1e} "
              f"{r.get('float64', float('nan')):9.1e}")
    by = {(r["model"], r["config"]): r for r in table}
    print()
    for kind in dict.fromkeys(r["model"] for r in table):
        parts = []
        if (kind, "la-jax") in by and (kind, "optax") in by:
            a, b = by[(kind, "la-jax")], by[(kind, "optax")]
            parts.append(f"la-jax / optax: time {a['window'] / b['window']:.2f}x, peak "
                         f"{a['peak'] / b['peak']:.2f}x")
        if (kind, "la-torch") in by and (kind, "torch-loop") in by:
            a, b = by[(kind, "la-torch")], by[(kind, "torch-loop")]
            parts.append(f"la-torch / torch-loop: time {a['window'] / b['window']:.2f}x, "
                         f"peak {a['peak'] / b['peak']:.2f}x")
        if parts:
            print(f"{kind}: " + "; ".join(parts))
    worst = {d: max((r.get(d, 0.0) for r in table), default=0.0)
             for d in ("float32", "float64")}
    print(f"largest difference from C's final parameters: {worst['float32']:.1e} in float32 "
          f"(target 1e-5), {worst['float64']:.1e} in float64 (target 1e-10)")
    if not on_gpu:
        print("no GPU here: every figure above is a CPU figure; the GPU figures are not "
              "measured yet (run scripts/check-gpu.sh on a GPU machine)")
    print(load_average())


if __name__ == "__main__":
    main()
