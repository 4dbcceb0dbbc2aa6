#!/usr/bin/env bash
# The main job: set up .venv, then reproduce the seed's table on bundled data
# Extra arguments go to the example (try --help).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
EXTRAS="${EXTRAS:-examples,test}" bash "$ROOT/scripts/setup.sh"
cd "$ROOT"
# PyTensor compiles each C op with "-g -O3": debug information nobody reads here, and -O3's
# extra compile time, which these small kernels do not win back. Without them cold runs
# (empty compile cache) took 49-64 s instead of 66-77 s, warm runs took as long, and the table
# was the same to every digit (README, "Compiler flags"). Your own PYTENSOR_FLAGS come after,
# so they win.
export PYTENSOR_FLAGS="gcc__cxxflags=-g0 -O2${PYTENSOR_FLAGS:+,$PYTENSOR_FLAGS}"
exec .venv/bin/python examples/cross_minibatch.py --quick "$@"
