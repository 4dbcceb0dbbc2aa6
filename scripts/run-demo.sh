#!/usr/bin/env bash
# The main job: set up .venv, then reproduce the seed's table on bundled data
# Extra arguments go to the example (try --help).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
EXTRAS="${EXTRAS:-examples,test}" bash "$ROOT/scripts/setup.sh"
cd "$ROOT"
exec .venv/bin/python examples/cross_minibatch.py --quick "$@"
