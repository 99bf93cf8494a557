#!/usr/bin/env bash
# On a machine with a CUDA GPU, one command: install what is missing, run the GPU-marked
# tests, and time the decode step of a Qwen2.5-0.5B-shaped random model at batch 1 and 64
# against the memory-bandwidth bound (tools/bench_decode.py), printing each figure.
#
#   bash tools/gpu_check.sh            # PYTHON=... to pick the interpreter
#
# The torch already installed stands (it must be a CUDA build); the package and its test
# extras are installed next to it (from wheels in .whl/ when the machine is offline).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
status=0

echo "== machine"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
if ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  echo "no CUDA device visible to torch ($("$PY" -c 'import torch; print(torch.__version__)' 2>&1)): nothing to check"
  exit 1
fi
"$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name())'

echo "== install"
if [ -d .whl ]; then
  "$PY" -m pip install -q --no-index --find-links .whl -e '.[test]' || status=1
else
  "$PY" -m pip install -q -e '.[test]' || "$PY" -m pip install -q --no-deps -e . || status=1
fi

echo "== GPU-marked tests"
"$PY" -m pytest -q -p no:cacheprovider -m gpu tests || status=1

echo "== tp 2 (nccl)"
if "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.device_count() >= 2 else 1)'; then
  echo "two or more GPUs: tests/integration/test_tensor_parallel.py's GPU test ran above"
else
  echo "one GPU: tp 2 over nccl needs two, not checked (its GPU test skips)"
fi

echo "== decode step against the bandwidth bound"
"$PY" tools/bench_decode.py --device cuda --dtype bfloat16 --batch 1 64 --context 512 \
  --steps 32 || status=1
exit $status
