#!/usr/bin/env bash
# Build the API reference (Sphinx + numpydoc) into docs/_build/html, with every
# warning an error. Sets up .venv with the `docs` extra first (see setup.sh).
# Extra arguments go to sphinx-build.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
EXTRAS="${EXTRAS:-docs}" bash "$ROOT/scripts/setup.sh"
cd "$ROOT"
exec .venv/bin/python -m sphinx -W --keep-going -b html docs docs/_build/html "$@"
