#!/usr/bin/env bash
# Set up .venv (with every optional backend: JAX, PyTorch, Dask, so that no test is
# skipped), then run the whole test suite (unit, property, backend and doctests).
# Extra arguments go to pytest (for example -x or -k adam).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
EXTRAS="${EXTRAS:-examples,test,distributed,backends}" bash "$ROOT/scripts/setup.sh"
cd "$ROOT"
exec .venv/bin/python -m pytest "$@"
