#!/usr/bin/env bash
# Regenerate what the user guide shows from the examples' own output: the tables in
# docs/_static/*.txt and the plots in examples/results/. Each takes seconds to minutes.
#   bash scripts/docs-results.sh                      # every one
#   bash scripts/docs-results.sh steps_to_target      # only the examples named
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
EXTRAS="${EXTRAS:-examples,test}" bash "$ROOT/scripts/setup.sh"
cd "$ROOT"
PY=.venv/bin/python
rc=.venv/pytensorrc
if [ -f "$rc" ]; then export PYTENSORRC="$ROOT/$rc:${PYTENSORRC:-$HOME/.pytensorrc}"; fi
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
ONLY="$*"
want() { [ -z "$ONLY" ] || [[ " $ONLY " == *" $1 "* ]]; }
if want large_batch_recipe; then
  $PY examples/large_batch_recipe.py --no-progress --out "$out" \
      | grep -E '^(base|\([a-z]\)) ' > docs/_static/large_batch_recipe.txt
  cp "$out/large_batch_recipe.png" examples/results/
fi
if want large_batch_small_memory; then
  $PY examples/large_batch_small_memory.py --no-progress --out "$out" \
      | sed -n '/^   N /,/^max difference/p' > docs/_static/large_batch_small_memory.txt
  cp "$out/large_batch_small_memory.png" examples/results/
fi
if want cross_minibatch; then
  $PY examples/cross_minibatch.py --quick --no-progress --out "$out" \
      | grep -E '^(control|cross) ' > docs/_static/cross_minibatch.txt
  cp "$out/cross_minibatch.png" examples/results/
fi
if want batch_size_noise_scale; then
  $PY examples/batch_size_noise_scale.py --out "$out" \
      | sed -n '/^run /,/^(-:/p' > docs/_static/batch_size_noise_scale.txt
  cp "$out/batch_size_noise_scale.png" examples/results/
fi
# the four findings of docs/reproducing.rst: each table with the time it took, and where
cpu="$(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -1)"
finding() {
    local name="$1"
    want "$name" || return 0
    local start=$SECONDS
    $PY "examples/$name.py" --no-progress --out "$out" > /dev/null
    { cat "$out/$name.txt"
      echo "($((SECONDS - start)) s on $(nproc) cores of ${cpu:-an unknown CPU})"
    } > "docs/_static/$name.txt"
    cp "$out/$name.png" examples/results/
}
finding increase_batch_size
finding steps_to_target
finding linear_scaling_warmup
finding ghost_batch_norm
echo "docs-results: docs/_static/*.txt and examples/results/*.png updated"
