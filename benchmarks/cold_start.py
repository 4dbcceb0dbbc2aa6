#!/usr/bin/env python
"""The demo's cold start: compiling on an empty cache, with and without tools/fastcompile.py.

Runs the main command's example (``examples/cross_minibatch.py --quick``, with the
compiler flags ``scripts/run-demo.sh`` sets) in a new, empty PyTensor compile
directory and Numba cache each time, alternating two configurations:

* ``fastcompile``: the example's default (precompiled headers, one compile per core);
* ``plain``: ``--no-pch --jobs 1``, PyTensor's own one-by-one compile;

then once more in the last directory (``warm``: nothing to compile). It prints each
run's wall time and the example's own "done in" time, the medians, and the ratio.

    python benchmarks/cold_start.py [--repeat 2]
    python benchmarks/cold_start.py --quick      # one run each, the MLP (smoke test)
"""

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import load_average, median  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = {"fastcompile": [], "plain": ["--no-pch", "--jobs", "1"]}


def run_demo(compiledir, extra, quick):
    flags = f"compiledir={compiledir},gcc__cxxflags=-g0 -O2"
    env = dict(os.environ, PYTENSOR_FLAGS=flags, NUMBA_CACHE_DIR=os.path.join(compiledir, "nb"))
    argv = ["examples/cross_minibatch.py", "--quick", "--no-plot", "--no-progress", *extra]
    if quick:
        argv += ["--model", "mlp", "--epochs", "1", "--rows", "1"]
    start = time.perf_counter()
    done = subprocess.run([sys.executable, *argv], cwd=ROOT, env=env, capture_output=True,
                          text=True)
    wall = time.perf_counter() - start
    if done.returncode:
        raise SystemExit(f"the demo failed: {done.stderr[-2000:]}")
    found = re.search(r"^done in ([\d.]+) s", done.stdout, re.M)
    return wall, float(found.group(1)) if found else float("nan")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeat", type=int, default=2, help="cold runs per configuration")
    p.add_argument("--quick", action="store_true", help="one run each, a small model")
    args = p.parse_args(argv)
    repeat = 1 if args.quick else args.repeat
    print(load_average())
    print("examples/cross_minibatch.py --quick, each run in an empty compile directory")
    print(f"{'run':>4} {'configuration':>12} {'wall s':>8} {'done in s':>10}")
    times = {name: [] for name in CONFIGS}
    last = None
    for k in range(repeat):
        for name, extra in CONFIGS.items():
            if last is not None:
                shutil.rmtree(last, ignore_errors=True)
            last = tempfile.mkdtemp(prefix="cold_start-")
            wall, done = run_demo(last, extra, args.quick)
            times[name].append(wall)
            print(f"{k + 1:>4} {name:>12} {wall:8.1f} {done:10.1f}", flush=True)
    wall, done = run_demo(last, CONFIGS["plain"], args.quick)
    print(f"{'':>4} {'warm':>12} {wall:8.1f} {done:10.1f}")
    shutil.rmtree(last, ignore_errors=True)
    fast, plain = median(times["fastcompile"]), median(times["plain"])
    print(f"median cold wall: fastcompile {fast:.1f} s, plain {plain:.1f} s; "
          f"fastcompile / plain {fast / plain:.2f}")
    print(load_average())


if __name__ == "__main__":
    main()
