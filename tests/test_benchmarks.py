"""Every benchmark script runs with ``--quick`` and prints its table.

Timings are never asserted (the machine is shared); the test checks that each
script finishes, prints the load average, and that the numbers of its table
are positive and finite. Slow (each script compiles its functions in fresh
worker processes): deselect with ``-m "not slow"``.
"""

import math
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "benchmarks")
SCRIPTS = sorted(f for f in os.listdir(BENCH) if f.endswith(".py") and f != "common.py")

# a line of each script's table, and which of its numbers must be positive
TABLE_ROW = {
    "accumulation.py": r"^ ?1 accumulate / fastest fwd-bwd\s+([\d.]+)",
    "backends.py": r"^numba\s+float32\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)",
    "distributed.py": r"\|\s*([\d.]+)\s*\|",
    "inplace.py": r"^NUMBA\s+float32\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)",
    "peers.py": r"^\s+1\s+([\d.]+)\s+([\d.]+)",
    "single_function.py": r"^NUMBA\s+([\d.]+)\s+([\d.]+)\s+lazy",
}


def test_every_script_has_a_table_check():
    assert sorted(TABLE_ROW) == SCRIPTS


@pytest.mark.slow
@pytest.mark.parametrize("script", SCRIPTS)
def test_benchmark_runs_quick(script):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, os.path.join(BENCH, script), "--quick"],
                          capture_output=True, text=True, timeout=1500, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    if script != "distributed.py":
        assert "load average" in proc.stdout
    match = re.search(TABLE_ROW[script], proc.stdout, re.MULTILINE)
    assert match, proc.stdout[-3000:]
    values = [float(v) for v in match.groups()]
    assert all(math.isfinite(v) and v > 0 for v in values), values
