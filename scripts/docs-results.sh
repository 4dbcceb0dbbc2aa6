#!/usr/bin/env bash
# Regenerate what the user guide shows from the examples' own output: the tables in
# docs/_static/*.txt and the plots in examples/results/. Each takes seconds to a minute.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
EXTRAS="${EXTRAS:-examples,test}" bash "$ROOT/scripts/setup.sh"
cd "$ROOT"
PY=.venv/bin/python
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
$PY examples/large_batch_recipe.py --no-progress --out "$out" \
    | grep -E '^(base|\([a-z]\)) ' > docs/_static/large_batch_recipe.txt
cp "$out/large_batch_recipe.png" examples/results/
$PY examples/large_batch_small_memory.py --no-progress --out "$out" \
    | sed -n '/^   N /,/^max difference/p' > docs/_static/large_batch_small_memory.txt
cp "$out/large_batch_small_memory.png" examples/results/
$PY examples/cross_minibatch.py --quick --no-progress --out "$out" \
    | grep -E '^(control|cross) ' > docs/_static/cross_minibatch.txt
cp "$out/cross_minibatch.png" examples/results/
$PY examples/batch_size_noise_scale.py --out "$out" \
    | sed -n '/^run /,/^(-:/p' > docs/_static/batch_size_noise_scale.txt
cp "$out/batch_size_noise_scale.png" examples/results/
$PY examples/increase_batch_size.py --no-progress --out "$out" > /dev/null
cp "$out/increase_batch_size.txt" docs/_static/
cp "$out/increase_batch_size.png" examples/results/
echo "docs-results: docs/_static/*.txt and examples/results/*.png updated"
