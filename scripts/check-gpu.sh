#!/usr/bin/env bash
# The GPU check: run on a machine with a GPU (it works on a CPU-only one too,
# and then says that its figures are CPU figures).
#   1. what the libraries see: nvidia-smi, torch.cuda, jax.devices();
#   2. benchmarks/gpu.py: time per window and peak device memory of the digits
#      CNN and a 4096-unit MLP at an effective batch of 4096 (B x N), for
#      lasagne_accum under JAX and PyTorch, optax's MultiSteps and a PyTorch
#      loop; final parameters against the C backend's;
#   3. the backend agreement tests (every backend against C; state on the
#      device; the memory plan), on whatever device torch and JAX pick
#      (CUDA when they see one).
# Uses $PYTHON, else .venv/bin/python, else python3; installs nothing. Extra
# arguments go to benchmarks/gpu.py (for example --quick, or --models mlp). On a
# GPU the PyTorch configurations compile with torch.compile on their first
# window (tens of seconds per function): allow about 10 minutes for the whole
# check, or start with --quick. JAX needs its CUDA build (jax[cuda12]) to see
# the GPU; the first lines say what each library sees. The output also goes to
# ${CHECK_GPU_LOG:-out/check-gpu.log}. Exit status: non-zero if a step failed.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON="${PYTHON:-}"
if [ -z "$PYTHON" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
LOG="${CHECK_GPU_LOG:-out/check-gpu.log}"
mkdir -p "$(dirname "$LOG")"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
status=0
{
  echo "check-gpu: $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname), $PYTHON"
  if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
  else
    echo "check-gpu: no nvidia-smi on this machine"
  fi
  "$PYTHON" - <<'PY' || status=1
import importlib.util
print("torch:", end=" ")
if importlib.util.find_spec("torch"):
    import torch
    print(torch.__version__, "cuda available:", torch.cuda.is_available(),
          [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])
else:
    print("not installed")
print("jax:", end=" ")
if importlib.util.find_spec("jax"):
    import jax
    print(jax.__version__, "devices:", jax.devices(), "default backend:", jax.default_backend())
else:
    print("not installed")
PY
  start=$(date +%s)
  "$PYTHON" benchmarks/gpu.py "$@" || { echo "check-gpu: benchmarks/gpu.py failed"; status=1; }
  echo "check-gpu: benchmark finished after $(( $(date +%s) - start )) s"
  "$PYTHON" -m pytest -q -p no:cacheprovider tests/test_backends.py tests/test_devices.py \
      tests/test_memory.py || { echo "check-gpu: agreement tests failed"; status=1; }
  echo "check-gpu: done after $(( $(date +%s) - start )) s, status $status"
  exit "$status"
} 2>&1 | tee "$LOG"
exit "${PIPESTATUS[0]}"
