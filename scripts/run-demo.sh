#!/usr/bin/env bash
# The main job: set up .venv, then reproduce the seed's table on bundled data
# Extra arguments go to the example (try --help).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
EXTRAS="${EXTRAS:-examples,test}" bash "$ROOT/scripts/setup.sh"
cd "$ROOT"
# the BLAS set-up.sh chose for PyTensor's C backend, where it wrote one (your own
# ~/.pytensorrc, on the right, wins)
rc="${VENV:-.venv}/pytensorrc"; case "$rc" in /*) ;; *) rc="$ROOT/$rc" ;; esac
if [ -f "$rc" ]; then export PYTENSORRC="$rc:${PYTENSORRC:-$HOME/.pytensorrc}"; fi
# PyTensor compiles each C op with "-g -O3": debug information nobody reads here, and -O3's
# extra compile time, which these small kernels do not win back (the table is the same to
# every digit). Your own PYTENSOR_FLAGS come after, so they win.
export PYTENSOR_FLAGS="gcc__cxxflags=-g0 -O2${PYTENSOR_FLAGS:+,$PYTENSOR_FLAGS}"
exec .venv/bin/python examples/cross_minibatch.py --quick "$@"
