#!/usr/bin/env python
"""Write docs/performance.rst from the benchmark scripts' own output.

Each topic of the page is one benchmark script run with its usual arguments;
its output is kept as printed (a ratio table measured side by side in one run,
with the load average), dated, with the commit, the machine and the exact
command that reproduces it. The runs are kept in
``docs/_static/performance.json`` so that one topic can be measured again
without the others (``--only``); the page is rewritten from that file every
time. Nothing on the page is typed by hand.

    python benchmarks/performance_page.py                  # every topic (about an hour)
    python benchmarks/performance_page.py --only cold_start single_function
    python benchmarks/performance_page.py --render         # rewrite the page from the file
"""

import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
STORE = os.path.join(ROOT, "docs", "_static", "performance.json")
PAGE = os.path.join(ROOT, "docs", "performance.rst")
OUTPUTS = ("docs/performance.rst", "docs/_static/performance.json")

#: topic -> (title, what it answers, the command, relative to the repository)
TOPICS = {
    "cold_start": (
        "Cold start",
        "How long the demo takes on an empty compile cache, with the compile-speed tool "
        "(``tools/fastcompile.py``: precompiled headers, parallel compiles) and without.",
        ["benchmarks/cold_start.py"]),
    "single_function": (
        "The single-function form and its fast paths",
        "What a call of ``average=N`` costs against the two-function form's accumulate step, "
        "and what each fast path of ``lasagne_accum.mode()`` saves (``ifelse``: without the "
        "lazy step; ``select``: without the reset folded into ``Gemm``; ``switch``: "
        "``lazy=False``).",
        ["benchmarks/single_function.py", "--modes", "CVM", "NUMBA", "--processes", "3"]),
    "inplace": (
        "The accumulate step against a forward-backward call",
        "Whether the accumulate step adds the gradient into its buffer in place, at no more "
        "than the cost of computing the gradient.",
        ["benchmarks/inplace.py"]),
    "noise": (
        "The noise scale's cost",
        "What ``compile_accumulation(noise_scale=True)`` adds to a window (one squared-norm "
        "reduction per micro-batch, the estimates at each apply), in C and Numba.",
        ["benchmarks/noise.py"]),
    "batch_norm": (
        "Batch normalisation",
        "A window with the exact large batch's statistics (``batch_norm=\"exact\"``, 2 L + 1 "
        "passes) against ghost batches, one and two batch-norm layers.",
        ["benchmarks/batch_norm.py"]),
    "backends": (
        "Backends",
        "Milliseconds per call of the forward-backward, accumulate and apply steps on each "
        "installed backend (the reason for ``default_modes()``).",
        ["benchmarks/backends.py", "--threads", "1"]),
    "accumulation": (
        "Accumulation's memory",
        "What one accumulate call allocates, and the peak memory of an effective batch of "
        "N x 64 examples by accumulation against the real batch, for N up to 16 (the "
        "steps' speed is in the other topics: the accumulate step above, the apply step "
        "under Backends, a whole window under Against PyTorch and optax).",
        ["benchmarks/accumulation.py", "--memory-only"]),
    "peers": (
        "Against PyTorch and optax",
        "The same accumulation in PyTorch (a hand-written loop) and optax (``MultiSteps``).",
        ["benchmarks/peers.py"]),
    "distributed": (
        "The parameter server",
        "The parameter server beside torch.distributed, and where a push's time goes.",
        ["benchmarks/distributed.py"]),
    "gpu": (
        "Large batches on a device",
        "Time per window and peak device memory at an effective batch of 4096, beside "
        "optax's MultiSteps and a PyTorch loop.",
        ["benchmarks/gpu.py"]),
}


#: An absolute path of two or more parts (an install's library directory in BLAS flags,
#: a temporary log): it names the measuring machine's files, not something a reader has.
_PATH = re.compile(r"(?<![\w.~/-])/(?:[\w.+~-]+/)+[\w.+~-]*")


def scrub(text):
    """`text` without the measuring machine's absolute paths (each becomes ``<path>``)."""
    return _PATH.sub("<path>", text)


def _git(*args):
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def machine(python=sys.executable):
    """One line naming the machine the benchmark ran on, and `python`'s version."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            names = [ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")]
        if names:
            cpu = names[0]
    except OSError:
        pass
    version = platform.python_version() if python == sys.executable else subprocess.run(
        [python, "-c", "import platform; print(platform.python_version())"],
        capture_output=True, text=True, check=True).stdout.strip()
    return (f"{cpu}, {os.cpu_count()} CPUs, {platform.system()} {platform.release()}, "
            f"Python {version}")


def pytensor_release(python):
    """``"3.3"``: the PyTensor release (major.minor) that `python` imports."""
    done = subprocess.run([python, "-c", "import pytensor; print(pytensor.__version__)"],
                          capture_output=True, text=True, check=True)
    return ".".join(done.stdout.strip().split(".")[:2])


def store_key(topic, python):
    """Where a run is stored: the topic, and ``topic:3.3`` for another PyTensor release
    than this interpreter's (``--python``), so that both releases' tables stay."""
    if python == sys.executable:
        return topic
    return f"{topic}:{pytensor_release(python)}"


def blas_line(python=sys.executable):
    """One line: the BLAS library and kernel of PyTensor's C backend, NumPy and SciPy (Numba's
    products) in `python`'s environment (``lasagne_accum.machine.blas_summary``)."""
    done = subprocess.run([python, "-c", "from lasagne_accum.machine import blas_summary; "
                           "print(blas_summary())"], cwd=ROOT, capture_output=True, text=True)
    if done.returncode:
        return "BLAS not reported (lasagne_accum.machine.blas_summary failed)"
    return "BLAS: " + done.stdout.strip()


def run(topic, python=sys.executable):
    """Run one topic's benchmark; its record for the store, or None if it failed."""
    _, _, command = TOPICS[topic]
    if not os.path.exists(os.path.join(ROOT, command[0])):
        print(f"{topic}: {command[0]} does not exist; its section says not measured",
              file=sys.stderr)
        return None
    print(f"running {' '.join(command)} ...", flush=True)
    done = subprocess.run([python, *command], cwd=ROOT, capture_output=True, text=True)
    if done.returncode:
        print(f"{topic}: exit {done.returncode}; its section keeps its last run\n"
              f"{done.stderr[-3000:]}", file=sys.stderr)
        return None
    # changes to tracked files other than this page and its store, which it writes itself
    dirty = any(line.split(maxsplit=1)[-1] not in OUTPUTS for line in
                _git("status", "--porcelain", "--untracked-files=no").splitlines())
    return {"date": datetime.date.today().isoformat(), "commit": _git("rev-parse", "--short",
                                                                        "HEAD"),
            "dirty": dirty, "machine": machine(python), "command": "python " + " ".join(command),
            "blas": scrub(blas_line(python)), "output": scrub(done.stdout.rstrip("\n"))}


def render(store):
    lines = ["Performance", "===========", "",
             "Every table on this page is a benchmark script's own output, kept as it "
             "printed, with the date, the commit and the machine it ran on and the command "
             "that reproduces it (``python benchmarks/performance_page.py`` rewrote this page "
             "from ``docs/_static/performance.json``). The scripts measure ratios side by "
             "side in one run, interleaved, and print the load average: on a shared machine "
             "compare the ratios, not the absolute times.", ""]
    for topic, (title, what, _) in TOPICS.items():
        lines += [title, "-" * len(title), "", what, ""]
        records = [(key, store[key]) for key in sorted(store)
                   if key == topic or key.startswith(topic + ":")]
        if not records:
            lines += ["Not measured yet.", ""]
            continue
        for key, record in records:
            commit = record["commit"] + (" with local changes" if record.get("dirty") else "")
            release = (f" with PyTensor {key.split(':', 1)[1]}" if ":" in key else "")
            lines += [f"Measured on {record['date']} at commit ``{commit}`` on "
                      f"{record['machine']}{release}; reproduce with ``{record['command']}``.",
                      "", f"``{record['blas']}``" if record.get("blas") else
                      "BLAS and kernel not recorded (measured before the page recorded them).",
                      "", "::", ""]
            lines += ["    " + ln if ln.strip() else ""
                      for ln in scrub(record["output"]).splitlines()]
            lines += [""]
    text = "\n".join(lines)
    with open(PAGE, "w") as f:
        f.write(text)
    return PAGE


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", nargs="+", choices=list(TOPICS), default=None,
                   help="measure these topics again, keep the others")
    p.add_argument("--render", action="store_true", help="only rewrite the page")
    p.add_argument("--python", default=sys.executable,
                   help="the interpreter that runs the benchmarks (another one, with another "
                        "PyTensor release, adds that release's tables beside this one's)")
    args = p.parse_args(argv)
    store = {}
    if os.path.exists(STORE):
        with open(STORE) as f:
            store = json.load(f)
    store = {topic: dict(record, output=scrub(record["output"]))
             for topic, record in store.items()}
    if not args.render:
        failed = []
        for topic in args.only or list(TOPICS):
            record = run(topic, args.python)
            if record is None:
                failed.append(topic)
                continue
            store[store_key(topic, args.python)] = record
            with open(STORE, "w") as f:
                json.dump(store, f, indent=1, sort_keys=True)
        print(f"wrote {render(store)}")
        if failed:
            raise SystemExit(f"not measured: {', '.join(failed)}")
        return
    with open(STORE, "w") as f:
        json.dump(store, f, indent=1, sort_keys=True)
    print(f"wrote {render(store)}")


if __name__ == "__main__":
    main()
