#!/usr/bin/env bash
# The main job: set up .venv, then train the example on bundled data.
# Extra arguments go to the example (try --help).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
EXTRAS="${EXTRAS:-examples,test}" bash "$ROOT/scripts/setup.sh"
cd "$ROOT"
exec .venv/bin/python examples/mlp_digits.py "$@"
