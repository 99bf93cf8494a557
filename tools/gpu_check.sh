#!/usr/bin/env bash
# On a machine with a CUDA GPU, the one command a lent GPU runs (well under ten minutes):
# install what is missing, run the GPU-marked tests, check a served worker on the GPU end to
# end (tools/gpu_check.py: greedy tokens equal transformers, logprobs, sampling, json_schema,
# LoRA, refit, memory release, a profile, a weight push; dp 2 too when two GPUs are visible),
# check the CUDA attention path against torch's and time both (tools/check_attention.py),
# then time the decode step against the memory-bandwidth bound (tools/bench_decode.py).
# One line per check, a summary at the end. Without a GPU it says so in one line.
#
#   bash tools/gpu_check.sh            # PYTHON=... to pick the interpreter
#
# The torch already installed stands (it must be a CUDA build); the package and its test
# extras are installed next to it (from wheels in .whl/ when the machine is offline).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

gpus=$("$PY" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)' 2>/dev/null)
if [ "${gpus:-0}" -eq 0 ]; then
  echo "gpu_check: no CUDA device visible to torch ($("$PY" -c 'import torch; print("torch", torch.__version__)' 2>&1 | tail -n 1)): nothing to check"
  exit 1
fi
status=0
echo "== machine"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
"$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(), "x", torch.cuda.device_count())'

echo "== install"
if [ -d .whl ]; then
  "$PY" -m pip install -q --no-index --find-links .whl -e '.[test]' || status=1
else
  "$PY" -m pip install -q -e '.[test]' || "$PY" -m pip install -q --no-deps -e . || status=1
fi

echo "== GPU-marked tests"
"$PY" -m pytest -q -p no:cacheprovider -m gpu tests || status=1

echo "== served worker, dp 1"
"$PY" tools/gpu_check.py --device cuda --dp-size 1 || status=1
if [ "$gpus" -ge 2 ]; then
  echo "== served worker, dp 2"
  "$PY" tools/gpu_check.py --device cuda --dp-size 2 || status=1
else
  echo "== dp 2 and an nccl push between GPUs: skipped, one GPU visible"
fi

echo "== tp 2 (nccl)"
if [ "$gpus" -ge 2 ]; then
  echo "two or more GPUs: tests/integration/test_tensor_parallel.py's GPU test ran above"
else
  echo "one GPU: tp 2 over nccl needs two, not checked (its GPU test skips)"
fi

echo "== attention: the CUDA path (Triton paged decode, mask-free prefix prefill) against torch's"
"$PY" tools/check_attention.py --device cuda --dtype bfloat16 --batch 64 --context 4096 \
  --graphs || status=1
"$PY" tools/check_attention.py --device cuda --dtype bfloat16 --batch 1 --context 8192 \
  --prefix 4096 --chunk 1024 || status=1
"$PY" tools/check_attention.py --device cuda --dtype float32 --batch 16 --context 1024 \
  --heads 8 --kv-heads 2 --head-dim 32 --window 256 --iters 5 || status=1

echo "== decode step against the bandwidth bound"
"$PY" tools/bench_decode.py --device cuda --dtype bfloat16 --batch 1 64 --context 512 \
  --steps 32 || status=1
if [ $status -eq 0 ]; then echo "gpu_check: every step passed"; else echo "gpu_check: a step FAILED (above)"; fi
exit $status
