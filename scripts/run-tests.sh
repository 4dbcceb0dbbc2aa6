#!/usr/bin/env bash
# Set up .venv, then run the whole test suite (unit, property and doctests).
# Extra arguments go to pytest (for example -x or -k adam).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
EXTRAS="${EXTRAS:-examples,test}" bash "$ROOT/scripts/setup.sh"
cd "$ROOT"
exec .venv/bin/python -m pytest "$@"
