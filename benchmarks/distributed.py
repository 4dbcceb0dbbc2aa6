#!/usr/bin/env python
"""The parameter server beside torch.distributed: samples per second, push time, time to accuracy.

One run prints, with the load average before and after:

1. **Side by side with torch.distributed**, on the digits (scikit-learn's
   8x8 images: 1347 training and 450 test examples, the same batches on both
   sides), 1 thread per process, 4 micro-batches accumulated per push, Adam:
   samples per second with 1 and 2 trainer processes and the 2/1 scaling, and
   the test accuracy reached, for

   * ours, Dask sync and async (``train(..., backend="dask")``: trainers in
     Dask worker processes, the shards in one more process of their own);
   * torch DDP over gloo, ``no_sync()`` for 3 of every 4 micro-batches (sync);
   * a torch.distributed.rpc parameter server (async): one server process
     applies each push with ``torch.optim.Adam`` and returns the parameters,
     trainers push gradients and pull parameters with ``rpc_sync`` (the design
     of PyTorch's parameter-server tutorial);

   on three models: a wide MLP (64-1024-1024-10, 1.1 M float32 parameters,
   batch 512: about 25 ms of gradient per micro-batch at 1 thread, so compute
   dominates), the digits CNN and the digits MLP (batch 32). Rounds are
   interleaved (the order rotating); the medians are printed.
2. **Where each push's time goes** (ours, wide MLP, 2 trainers): computing
   the gradients, preparing the request, the transport, the shard process's
   work, and waiting for the other trainer's push (sync rounds); measured with
   ``train(..., profile=True)``.
3. **Time to 95% test accuracy** on the digits CNN: Dask async with 2
   trainers against 1 local thread (``backend="local"``), from the start of
   training (compiling excluded), medians of interleaved runs.
4. **The transport** (Dask's pooled comms): a no-op request and a push of
   the digits MLP from this process to the shard process.

Every process listens on 127.0.0.1 only (checked and printed) and is stopped
by this script, by its process id. Without torch.distributed the torch rows
are skipped with a message.

    python benchmarks/distributed.py            # about 10 minutes on 2 cores
    python benchmarks/distributed.py --quick    # about 2 minutes: the wide MLP only
"""

import argparse
import collections
import json
import os
import signal
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
# this file is called distributed.py: keep `import distributed` meaning Dask's package
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != HERE]
sys.path.insert(0, os.path.join(HERE, "..", "examples"))


def _load_common():
    """The harness, ``benchmarks/common.py``, loaded by path (this directory stays off
    ``sys.path``)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_common",
                                                  os.path.join(HERE, "common.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


common = _load_common()

ACCUMULATE = 4
Model = collections.namedtuple("Model", "name description batch lr pushes")
MODELS = {      # pushes: per trainer and run (full, quick)
    "wide": Model("wide MLP", "64-1024-1024-10, 1.1 M float32 parameters, batch 512", 512,
                  1e-3, (20, 6)),
    "cnn": Model("digits CNN", "3x3x16 convolution, 2x2 max-pool, 64, 10; batch 32", 32, 3e-3,
                 (150, 60)),
    "mlp": Model("digits MLP", "64-64-10, batch 32", 32, 3e-3, (300, 100)),
}
RPC_OPTIONS = json.loads(os.environ.get("BENCH_RPC_OPTIONS", '{"_transports": ["uv"]}'))
TARGET_ACCURACY = 0.95
LOOPBACK = ("127.0.0.1", "::1")
# torch.distributed's sockets on the loopback interface only
TORCH_ENV = {"GLOO_SOCKET_IFNAME": "lo", "TP_SOCKET_IFNAME": "lo"}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="the wide MLP only, one round, fewer pushes (about 2 minutes)")
    p.add_argument("--rounds", type=int, default=None,
                   help="interleaved rounds per configuration (default 5; quick: 1)")
    p.add_argument("--models", default=None,
                   help="comma-separated models of the side-by-side table (default "
                        "wide,cnn,mlp; quick: wide)")
    p.add_argument("--shard-processes", type=int, default=1,
                   help="processes that hold our shards and run no trainer (0: the shards "
                        "beside the trainers)")
    p.add_argument("--no-torch", action="store_true", help="leave out the torch rows")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--world", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--store", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.rounds = args.rounds or (1 if args.quick else 5)
    args.models = (args.models or ("wide" if args.quick else "wide,cnn,mlp")).split(",")
    for m in args.models:
        if m not in MODELS:
            p.error(f"unknown model {m!r} (one of {', '.join(MODELS)})")
    return args


# --------------------------------------------------------------------------
# the models and the data: one definition for both libraries
# --------------------------------------------------------------------------
def digits():
    """``(X_train, y_train, X_test, y_test)``: the digits, split by seed 0."""
    import models

    return models.load_digits(0)


def initial_values(kind, seed=0):
    """The models' initial parameters (numpy, float32), Glorot-uniform, biases 0."""
    rng = np.random.RandomState(seed)

    def glorot(shape, fan_in, fan_out):
        bound = np.sqrt(6.0 / (fan_in + fan_out))
        return rng.uniform(-bound, bound, shape).astype("float32")

    if kind == "cnn":
        return {"W_conv": glorot((9, 16), 9, 144), "b_conv": np.zeros(16, "float32"),
                "W1": glorot((144, 64), 144, 64), "b1": np.zeros(64, "float32"),
                "W2": glorot((64, 10), 64, 10), "b2": np.zeros(10, "float32")}
    sizes = (64, 1024, 1024, 10) if kind == "wide" else (64, 64, 10)
    out = {}
    for i, (n_in, n_out) in enumerate(zip(sizes[:-1], sizes[1:]), 1):
        out[f"W{i}"] = glorot((n_in, n_out), n_in, n_out)
        out[f"b{i}"] = np.zeros(n_out, "float32")
    return out


def pytensor_logits(kind, x, params):
    """The models' logits in PyTensor (`params`: shared variables by name)."""
    import models
    import pytensor.tensor as pt

    if kind == "cnn":
        images = x.reshape((x.shape[0], 8, 8, 1))
        maps = pt.maximum(models.conv2d(images, params["W_conv"], params["b_conv"], 3, 8, 8),
                          0)
        h = models.max_pool_2x2(maps, 6, 6).reshape((x.shape[0], 144))
        h = pt.maximum(h @ params["W1"] + params["b1"], 0)
        return h @ params["W2"] + params["b2"]
    layers = len(params) // 2
    h = x
    for i in range(1, layers + 1):
        h = h @ params[f"W{i}"] + params[f"b{i}"]
        if i < layers:
            h = pt.maximum(h, 0)
    return h


def build_model(kind="wide", seed=0):
    """``(inputs, loss, params)`` for the parameter server: mean cross-entropy."""
    import pytensor
    import pytensor.tensor as pt

    params = {n: pytensor.shared(v, name=n) for n, v in initial_values(kind, seed).items()}
    x, y = pt.matrix("x", dtype="float32"), pt.vector("y", dtype="int64")
    logits = pytensor_logits(kind, x, params)
    log_probs = logits - pt.logsumexp(logits, axis=1, keepdims=True)
    return [x, y], -log_probs[pt.arange(y.shape[0]), y].mean(), list(params.values())


def accuracy_fn(kind):
    """``accuracy(values, X, y)``: the test accuracy of parameter values ``{name: array}``."""
    import pytensor
    import pytensor.tensor as pt

    params = {n: pytensor.shared(v, name=n) for n, v in initial_values(kind).items()}
    x, y = pt.matrix("x", dtype="float32"), pt.vector("y", dtype="int64")
    fn = pytensor.function([x, y], pt.eq(pt.argmax(pytensor_logits(kind, x, params), 1),
                                         y).mean())

    def accuracy(values, X, y_):
        for n, p in params.items():
            p.set_value(np.asarray(values[n], dtype="float32"))
        return float(fn(X, y_))

    return accuracy


def trainer_batches(kind, k, n_trainers, pushes, seed=0):
    """Trainer `k`'s batches: its share (examples k, k + n, ...), reshuffled every pass,
    ``pushes * ACCUMULATE`` batches of the model's batch size."""
    X, y = digits()[:2]
    X, y = X[k::n_trainers], y[k::n_trainers]
    batch = MODELS[kind].batch
    rng = np.random.RandomState(1000 * seed + k)
    need = pushes * ACCUMULATE * batch
    order = np.concatenate([rng.permutation(len(X))
                            for _ in range(-(-need // len(X)))])[:need]
    return [(X[order[i:i + batch]], y[order[i:i + batch]]) for i in range(0, need, batch)]


def our_batches(kind, n_trainers, pushes, k):
    """What a Dask task calls for its batches (made there: the data do not travel)."""
    return trainer_batches(kind, k, n_trainers, pushes)


# --------------------------------------------------------------------------
# torch.distributed: worker processes (``--worker torch-ddp`` / ``torch-rpc``)
# --------------------------------------------------------------------------
def torch_model(kind):
    """The same network in torch, from the same initial values."""
    import torch

    values = {n: torch.from_numpy(v.copy()) for n, v in initial_values(kind).items()}

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.p = torch.nn.ParameterDict({n: torch.nn.Parameter(v) for n, v in
                                             values.items()})

        def forward(self, x):
            p = self.p
            if kind == "cnn":
                w = p["W_conv"].t().reshape(16, 1, 3, 3)          # [i * 3 + j, f] -> [f, i, j]
                maps = torch.relu(torch.nn.functional.conv2d(x.reshape(-1, 1, 8, 8), w,
                                                             p["b_conv"]))
                h = torch.nn.functional.max_pool2d(maps, 2).permute(0, 2, 3, 1)
                h = torch.relu(h.reshape(x.shape[0], 144) @ p["W1"] + p["b1"])
                return h @ p["W2"] + p["b2"]
            layers = len(p) // 2
            h = x
            for i in range(1, layers + 1):
                h = h @ p[f"W{i}"] + p[f"b{i}"]
                if i < layers:
                    h = torch.relu(h)
            return h

    return Net()


def listening_here():
    """This process's listening sockets, ``[(address, port)]``."""
    import psutil

    return sorted({(c.laddr.ip, c.laddr.port) for c in psutil.Process().net_connections("inet")
                   if c.status == psutil.CONN_LISTEN})


def _send(proto, **message):
    proto.write(common.PROTO + json.dumps(message) + "\n")


def _accumulate(net, batches, start, torch):
    """Forward-backward of ACCUMULATE micro-batches from `start`, the loss scaled to their mean."""
    for i in range(start, start + ACCUMULATE):
        x, y = batches[i]
        (torch.nn.functional.cross_entropy(net(x), y) / ACCUMULATE).backward()


def _tensors(kind, k, n_trainers, pushes, torch):
    return [(torch.from_numpy(x), torch.from_numpy(y))
            for x, y in trainer_batches(kind, k, n_trainers, pushes)]


def torch_ddp_worker(args, proto):
    """A DDP rank: per run, the model's pushes with ``no_sync`` for all but the last
    micro-batch of each push; rank 0 reports the test accuracy."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.FileStore(args.store, args.world)
    dist.init_process_group("gloo", store=store, rank=args.rank, world_size=args.world)
    X_test, y_test = (torch.from_numpy(a) for a in digits()[2:])
    _send(proto, ready=dict(listening=listening_here()))
    for line in sys.stdin:
        if not line.startswith("run "):
            break
        spec = json.loads(line[4:])
        kind, pushes = spec["kind"], spec["pushes"]
        batches = _tensors(kind, args.rank, args.world, pushes, torch)
        net = torch.nn.parallel.DistributedDataParallel(torch_model(kind))
        opt = torch.optim.Adam(net.parameters(), lr=MODELS[kind].lr)
        with net.no_sync():                      # warm-up, no step: the weights stay as built
            _accumulate(net, batches, 0, torch)
        opt.zero_grad()
        dist.barrier()
        t_start, compute = time.time(), 0.0
        for push in range(pushes):
            begin = time.perf_counter()
            first, last = push * ACCUMULATE, push * ACCUMULATE + ACCUMULATE - 1
            with net.no_sync():                  # no all-reduce for the first three
                for x, y in batches[first:last]:
                    (torch.nn.functional.cross_entropy(net(x), y) / ACCUMULATE).backward()
            x, y = batches[last]                 # this backward all-reduces the gradients
            (torch.nn.functional.cross_entropy(net(x), y) / ACCUMULATE).backward()
            compute += time.perf_counter() - begin
            opt.step()
            opt.zero_grad()
        t_end = time.time()
        accuracy = None
        if args.rank == 0:
            with torch.no_grad():
                accuracy = float((net.module(X_test).argmax(1) == y_test).float().mean())
        _send(proto, result=dict(t_start=t_start, t_end=t_end, compute=compute,
                                 samples=pushes * ACCUMULATE * MODELS[kind].batch,
                                 pushes=pushes, accuracy=accuracy))
        dist.barrier()
    dist.destroy_process_group()


class _RpcServer:
    """The rpc parameter server's state (in its process): the model and its Adam."""

    net = opt = lock = None


def _rpc_reset(kind):
    import threading

    import torch

    _RpcServer.net = torch_model(kind)
    _RpcServer.opt = torch.optim.Adam(_RpcServer.net.parameters(), lr=MODELS[kind].lr)
    _RpcServer.lock = threading.Lock()


def _rpc_fetch():
    with _RpcServer.lock:
        return [p.detach().clone() for p in _RpcServer.net.parameters()]


def _rpc_update_and_fetch(grads):
    """Apply one trainer's push at once (async) and return the parameters after it."""
    with _RpcServer.lock:
        for p, g in zip(_RpcServer.net.parameters(), grads):
            p.grad = g
        _RpcServer.opt.step()
        return [p.detach().clone() for p in _RpcServer.net.parameters()]


def torch_rpc_worker(args, proto):
    """Rank 0: the parameter server (reset per run, reports the test accuracy at the end);
    other ranks: trainers that push with rpc_sync and copy the parameters returned."""
    import torch
    import torch.distributed.rpc as rpc

    torch.set_num_threads(1)
    options = rpc.TensorPipeRpcBackendOptions(init_method=f"file://{args.store}",
                                              num_worker_threads=8,
                                              **RPC_OPTIONS)
    rpc.init_rpc(f"rank{args.rank}", rank=args.rank, world_size=args.world,
                 rpc_backend_options=options)
    X_test, y_test = (torch.from_numpy(a) for a in digits()[2:])
    _send(proto, ready=dict(listening=listening_here()))
    trainers = args.world - 1
    for line in sys.stdin:
        if not line.startswith("run "):
            break
        spec = json.loads(line[4:])
        kind, pushes = spec["kind"], spec["pushes"]
        if args.rank == 0:
            _rpc_reset(kind)
            _send(proto, reset=True)
            sys.stdin.readline()                  # "end": every trainer has finished
            with torch.no_grad():
                accuracy = float((_RpcServer.net(X_test).argmax(1) == y_test).float().mean())
            _send(proto, result=dict(accuracy=accuracy))
            continue
        batches = _tensors(kind, args.rank - 1, trainers, pushes, torch)
        net = torch_model(kind)
        with torch.no_grad():
            for p, v in zip(net.parameters(), rpc.rpc_sync("rank0", _rpc_fetch)):
                p.copy_(v)
        _accumulate(net, batches, 0, torch)       # warm-up, no push
        net.zero_grad()
        _send(proto, warm=True)
        sys.stdin.readline()                      # "go": all trainers start together
        t_start, compute = time.time(), 0.0
        for push in range(pushes):
            begin = time.perf_counter()
            _accumulate(net, batches, push * ACCUMULATE, torch)
            compute += time.perf_counter() - begin
            new = rpc.rpc_sync("rank0", _rpc_update_and_fetch,
                               args=([p.grad for p in net.parameters()],))
            with torch.no_grad():
                for p, v in zip(net.parameters(), new):
                    p.copy_(v)
                    p.grad = None
        _send(proto, result=dict(t_start=t_start, t_end=time.time(), compute=compute,
                                 samples=pushes * ACCUMULATE * MODELS[kind].batch,
                                 pushes=pushes))
    rpc.shutdown()


class TorchGroup:
    """The processes of one torch.distributed job (DDP ranks, or an rpc server and trainers),
    kept for every round: started here, stopped here by process id."""

    def __init__(self, kind, world, log):
        self.kind = kind
        self.store = tempfile.mktemp(prefix=f"lasagne-bench-{kind}-", dir=tempfile.gettempdir())
        env = dict(os.environ, **TORCH_ENV)
        self.ranks = [common.Worker(__file__, f"torch-{kind}", threads=1, log=log, env=env,
                                    args=["--rank", str(r), "--world", str(world),
                                          "--store", self.store],
                                    label=f"{kind}{world}/{r}")
                      for r in range(world)]
        self.meta = [w.ready() for w in self.ranks]

    def listening(self):
        return [tuple(a) for m in self.meta for a in m["listening"]]

    def _write(self, w, line):
        w.proc.stdin.write(line + "\n")
        w.proc.stdin.flush()

    def run(self, model, pushes):
        """One run; ``(samples/s, accuracy, compute seconds per push)``."""
        line = "run " + json.dumps(dict(kind=model, pushes=pushes))
        if self.kind == "ddp":
            for w in self.ranks:
                self._write(w, line)
            results = [w.read()["result"] for w in self.ranks]
            accuracy = results[0]["accuracy"]
        else:
            server, trainers = self.ranks[0], self.ranks[1:]
            self._write(server, line)
            server.read()                                   # reset
            for w in trainers:
                self._write(w, line)
            for w in trainers:
                w.read()                                    # warm
            for w in trainers:
                self._write(w, "go")
            results = [w.read()["result"] for w in trainers]
            self._write(server, "end")
            accuracy = server.read()["result"]["accuracy"]
        elapsed = max(r["t_end"] for r in results) - min(r["t_start"] for r in results)
        compute = sum(r["compute"] for r in results) / sum(r["pushes"] for r in results)
        return sum(r["samples"] for r in results) / elapsed, accuracy, compute

    def close(self):
        for w in self.ranks:
            if w.proc.poll() is None:
                try:
                    w.proc.stdin.close()
                except OSError:
                    pass
        stop_processes([w.proc for w in self.ranks])
        for path in (self.store,):
            if os.path.exists(path):
                os.unlink(path)


def stop_processes(procs, timeout=20.0):
    """Wait for `procs` (subprocess.Popen) to exit; SIGKILL by process id those that do not."""
    end = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(timeout=max(0.1, end - time.monotonic()))
        except Exception:
            os.kill(p.pid, signal.SIGKILL)
            p.wait()


def torch_available():
    """None if torch.distributed (gloo and rpc) is usable here, else why not."""
    if not common.have_module("torch"):
        return "torch is not installed"
    import subprocess

    check = ("import torch.distributed as d, torch.distributed.rpc as r; "
             "assert d.is_available() and d.is_gloo_available() and r.is_available()")
    if subprocess.run([sys.executable, "-c", check], capture_output=True).returncode:
        return "torch.distributed (gloo, rpc) is not available in this torch build"
    return None


# --------------------------------------------------------------------------
# ours
# --------------------------------------------------------------------------
def ours(client, model, mode, trainers, pushes, shard_processes, accuracy):
    """One run of ours on the Dask cluster; ``(samples/s, accuracy, result)``."""
    import functools

    from lasagne_accum import adam
    from lasagne_accum.distributed import DaskOptions, train

    X_test, y_test = digits()[2:]
    result = train(functools.partial(build_model, kind=model),
                   functools.partial(our_batches, model, trainers, pushes), adam,
                   dict(learning_rate=MODELS[model].lr), n_workers=trainers, mode=mode,
                   backend="dask", accumulate=ACCUMULATE,
                   profile=True, dask=DaskOptions(client=client, shard_processes=shard_processes))
    return (result.examples / result.elapsed, accuracy(result.params, X_test, y_test),
            result)


def parts_per_push(results):
    """Mean ms per push: compute, serialise, transport, shard, round wait; and the push."""
    pushes = sum(r.pushes for r in results)
    total = {k: 0.0 for k in ("compute", "serialise", "transport", "shard", "round", "push")}
    for r in results:
        for w in r.workers:
            total["compute"] += w["compute_s"]
            total["push"] += w["server_s"]
            for k in ("serialise", "shard", "round"):
                total[k] += w["parts"][k]
    total["transport"] = total["push"] - total["serialise"] - total["shard"] - total["round"]
    return {k: v / pushes * 1e3 for k, v in total.items()}


def time_to_accuracy(result, accuracy, X, y):
    """Seconds from the start of training to the first snapshot at TARGET_ACCURACY."""
    for t, _, params in result.history:
        if t >= result.t_start and accuracy(params, X, y) >= TARGET_ACCURACY:
            return t - result.t_start
    return float("nan")


def transport_probe(client, n):
    """Median ms of a no-op request and of a push (digits MLP, async, pull=True) from this
    process to the shard process."""
    from lasagne_accum import adam
    from lasagne_accum.distributed.dask import DaskParameterServer
    from lasagne_accum.distributed.dask.cluster import worker_addresses

    first = worker_addresses(client)[0]
    params = initial_values("mlp")
    grads = {k: np.zeros_like(v) for k, v in params.items()}
    server = DaskParameterServer(client, params, adam, dict(learning_rate=1e-3),
                                 mode="async", workers=[first])
    try:
        version, _ = server.register("probe")
        noop, push = [], []
        for seq in range(n):
            t = time.perf_counter()
            server.actor_pids()
            noop.append(time.perf_counter() - t)
            t = time.perf_counter()
            version = server.push("probe", seq, grads, version=version, pull=True)["version"]
            push.append(time.perf_counter() - t)
    finally:
        server.close()
    return {"Dask comms": (np.median(noop) * 1e3, np.median(push) * 1e3)}


# --------------------------------------------------------------------------
# the run
# --------------------------------------------------------------------------
def fmt(x, digits=0):
    return "n/a" if x is None or not np.isfinite(x) else f"{x:.{digits}f}"


def main(argv=None):
    args = parse_args(argv)
    if args.worker:
        proto = common.worker_io()
        {"torch-ddp": torch_ddp_worker, "torch-rpc": torch_rpc_worker}[args.worker](args, proto)
        return
    import functools

    from lasagne_accum import adam
    from lasagne_accum.distributed import Checkpoint, DaskOptions, train
    from lasagne_accum.distributed.dask import local_cluster

    start = time.perf_counter()
    load_before = common.load_average()
    why_not = "left out (--no-torch)" if args.no_torch else torch_available()
    X_train, y_train, X_test, y_test = digits()
    accuracy = {m: accuracy_fn(m) for m in set(args.models) | {"cnn"}}
    pushes = {m: MODELS[m].pushes[bool(args.quick)] for m in MODELS}
    runs = {}                      # (model, system, n) -> [(samples/s, accuracy)]
    breakdown = {}                 # mode -> [TrainResult]
    listening = []                 # (who, address, port)
    loads = []                     # the 1-minute load average as each round began
    ttt = {"dask async, 2 trainers": [], "local, 1 thread": []}
    log = common.worker_log("bench-distributed")
    groups = {}
    with local_cluster(2 + args.shard_processes) as client:
        client.wait_for_workers(2 + args.shard_processes, timeout=120)
        for address, socks in client.run(listening_here).items():
            listening += [(f"dask worker {address}", a, p) for a, p in socks]
        try:
            if why_not is None:
                for kind, world in (("ddp", 1), ("ddp", 2), ("rpc", 2), ("rpc", 3)):
                    groups[kind, world] = TorchGroup(kind, world, log)
                    listening += [(f"torch {kind} x{world}", a, p)
                                  for a, p in groups[kind, world].listening()]
            configs = []
            for model in args.models:
                for n in (1, 2):
                    configs += [(model, "ours, Dask sync", n), (model, "ours, Dask async", n)]
                    if why_not is None:
                        configs += [(model, "torch DDP (gloo)", n),
                                    (model, "torch rpc server", n)]
            def run(model, system, n, count):
                """One run: ``(samples/s, test accuracy, compute ms per push, result)``."""
                if system.startswith("ours"):
                    sps, acc, result = ours(client, model, system.rsplit(" ", 1)[1], n, count,
                                            args.shard_processes, accuracy[model])
                    compute = parts_per_push([result])["compute"]
                    return sps, acc, compute, result
                group = groups["ddp", n] if "DDP" in system else groups["rpc", n + 1]
                sps, acc, compute = group.run(model, count)
                return sps, acc, compute * 1e3, None

            for model, system, n in configs:       # first runs in fresh processes: not kept
                run(model, system, n, 2)
            for r in range(args.rounds):
                order = configs[r % len(configs):] + configs[:r % len(configs)]
                loads.append(os.getloadavg()[0])
                for model, system, n in order:
                    sps, acc, compute, result = run(model, system, n, pushes[model])
                    if result is not None and model == "wide" and n == 2:
                        breakdown.setdefault(system.rsplit(" ", 1)[1], []).append(result)
                    runs.setdefault((model, system, n), []).append((sps, acc, compute))
                    print(f"  round {r + 1}: {model} {system} x{n}: {sps:.0f} samples/s, "
                          f"test accuracy {acc:.3f}, compute {compute:.1f} ms per push",
                          file=sys.stderr, flush=True)
                # time to accuracy: Dask async with 2 trainers against 1 local thread
                epochs = 12 if args.quick else 30
                cnn_pushes = epochs * len(X_train) // (MODELS["cnn"].batch * ACCUMULATE)
                for name in (list(ttt) if r % 2 == 0 else list(ttt)[::-1]):
                    kw = dict(mode="async", accumulate=ACCUMULATE,
                              checkpoint=Checkpoint(snapshot_every=0.01))
                    cnn = functools.partial(build_model, kind="cnn")
                    if name.startswith("dask"):
                        result = train(cnn, functools.partial(
                            our_batches, "cnn", 2, cnn_pushes // 2), adam,
                            dict(learning_rate=MODELS["cnn"].lr), n_workers=2, backend="dask",
                            dask=DaskOptions(client=client,
                                             shard_processes=args.shard_processes), **kw)
                    else:
                        result = train(cnn, [trainer_batches("cnn", 0, 1, cnn_pushes)],
                                       adam, dict(learning_rate=MODELS["cnn"].lr),
                                       backend="local", **kw)
                    ttt[name].append((time_to_accuracy(result, accuracy["cnn"], X_test, y_test),
                                      accuracy["cnn"](result.params, X_test, y_test),
                                      result.elapsed))
                    print(f"  round {r + 1}: time to {TARGET_ACCURACY:.0%}, {name}: "
                          f"{ttt[name][-1][0]:.2f} s", file=sys.stderr, flush=True)
            probe = transport_probe(client, 50 if args.quick else 200)
        finally:
            for g in groups.values():
                g.close()
    load_after = common.load_average()

    # ---------------------------------------------------------------- the tables
    print(f"\nBefore: {load_before}\nAfter: {load_after}")
    outside = [(who, a, p) for who, a, p in listening if a not in LOOPBACK]
    print(f"Listening sockets of the processes started: {len(listening)}, "
          + ("all on 127.0.0.1" if not outside else f"NOT ON LOOPBACK: {outside}"))
    if why_not is not None:
        print(f"\ntorch.distributed rows skipped: {why_not}.")
    print(f"\n## Side by side (1 thread per process, {ACCUMULATE} micro-batches per push, Adam; "
          f"medians of {args.rounds} interleaved round(s))\n")
    print("Samples per second of training (compiling and start-up excluded); 'processes' "
          "counts trainers: ours adds one process holding the shards"
          + (" (none: shards beside the trainers)" if not args.shard_processes else "")
          + ", the rpc server one process. Test accuracy on the 450 digits test images after "
          "the run (2 processes).\n")
    print("| model | system | 1 process | 2 processes | 2 / 1 | vs torch, 2 processes | "
          "test accuracy |")
    print("|---|---|---|---|---|---|---|")
    med = {k: tuple(float(np.median(column)) for column in zip(*v)) for k, v in runs.items()}
    for model in args.models:
        for system in ("ours, Dask sync", "torch DDP (gloo)", "ours, Dask async",
                       "torch rpc server"):
            if (model, system, 1) not in med:
                continue
            one, two = med[model, system, 1][0], med[model, system, 2][0]
            rival = {"ours, Dask sync": "torch DDP (gloo)",
                     "ours, Dask async": "torch rpc server"}.get(system)
            versus = (f"{two / med[model, rival, 2][0]:.2f}x"
                      if rival and (model, rival, 2) in med else "")
            print(f"| {MODELS[model].name} | {system} | {one:.0f} | {two:.0f} | "
                  f"{two / one:.2f}x | {versus} | {med[model, system, 2][1]:.3f} |")
    if args.rounds > 1 and "wide" in args.models:
        systems = [s for s in ("ours, Dask sync", "torch DDP (gloo)", "ours, Dask async",
                               "torch rpc server") if ("wide", s, 1) in runs]
        print(f"\n{MODELS['wide'].name}, each round (samples/s, 1 / 2 processes; the "
              "1-minute load average as the round began):\n")
        print("| round | load | " + " | ".join(systems) + " |")
        print("|---|---|" + "---|" * len(systems))
        for r, load in enumerate(loads):
            print(f"| {r + 1} | {load:.2f} | " + " | ".join(
                f"{runs['wide', s, 1][r][0]:.0f} / {runs['wide', s, 2][r][0]:.0f}"
                for s in systems) + " |")
    print("\nModels: " + "; ".join(f"{MODELS[m].name}: {MODELS[m].description}, "
                                   f"{MODELS[m].pushes[bool(args.quick)]} pushes per trainer, "
                                   f"Adam lr {MODELS[m].lr}" for m in args.models) + ".")
    if breakdown:
        print(f"\n## Where a push's time goes (ours, {MODELS['wide'].name}, 2 trainers; "
              "ms per push, means over the runs)\n")
        print("Compute: the 4 forward-backward calls and reading the accumulated gradient; "
              "request: preparing this trainer's (its arrays wrapped as Dask frames); shard "
              "process: the request's seconds there besides waiting for the round (checks, "
              "merge, apply, copy); transport: the rest of the push call (checks here, Dask's "
              "encoding and decoding, sockets, waiting for a CPU).\n")
        print("| mode | compute (4 micro-batches) | request | transport | "
              "shard process | waiting for the round | push call |")
        print("|---|---|---|---|---|---|---|")
        for mode in ("sync", "async"):
            if mode in breakdown:
                p = parts_per_push(breakdown[mode])
                print(f"| {mode} | {p['compute']:.1f} | {p['serialise']:.2f} | "
                      f"{p['transport']:.2f} | {p['shard']:.2f} | {p['round']:.2f} | "
                      f"{p['push']:.2f} |")
        rivals = [(s, med["wide", s, 2][2]) for s in ("torch DDP (gloo)", "torch rpc server")
                  if ("wide", s, 2) in med]
        if rivals:
            print("\nThe same 4 micro-batches' forward and backward in torch, same runs (median "
                  "ms per push): " + ", ".join(f"{s} {c:.1f}" for s, c in rivals) + ".")
    print(f"\n## Time to {TARGET_ACCURACY:.0%} test accuracy, {MODELS['cnn'].name}, "
          f"{ACCUMULATE} per push, Adam lr {MODELS['cnn'].lr} (medians of {args.rounds})\n")
    print("| run | seconds to 95% | final test accuracy | training seconds |")
    print("|---|---|---|---|")
    for name, values in ttt.items():
        t = [v[0] for v in values]
        reached = [x for x in t if np.isfinite(x)]
        shown = fmt(float(np.median(t)), 2) if len(reached) == len(t) else \
            f"not reached in {len(t) - len(reached)} of {len(t)}"
        print(f"| {name} | {shown} | {np.median([v[1] for v in values]):.3f} | "
              f"{np.median([v[2] for v in values]):.1f} |")
    print("\n## Transport (this process to the shard process, medians, ms)\n")
    print("| transport | no-op request | push, digits MLP (pull=True) |")
    print("|---|---|---|")
    for transport, (noop, push) in probe.items():
        print(f"| {transport} | {noop:.3f} | {push:.3f} |")
    print(f"\n(total {time.perf_counter() - start:.0f} s; torch workers' log: {log.name})")


if __name__ == "__main__":
    main()
