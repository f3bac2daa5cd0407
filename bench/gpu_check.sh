#!/usr/bin/env bash
# GPU check for the backend core, for a machine with an NVIDIA GPU and JAX's CUDA plugin (gradio
# not needed). Runs from the repository root in about 12 minutes on an H200 (serving about 4 of them):
#   bash bench/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
echo "== python -m migration env"
python3 -m migration env --platform gpu || exit 1
echo
echo "== gpt2-small on the local GPU"
python3 bench/gpu_check.py "$@" || status=1
echo
echo "== planner: predicted vs measured peak memory and step time on the local GPU"
python3 bench/planner_gpu_check.py || status=1
echo
echo "== llama 1b planned for the local GPU, replicated vs FSDP over one device"
python3 bench/gpu_check_fsdp.py || status=1
echo
echo "== speed: gpt2-small and gpt2-medium, attention and remat variants, autotune"
python3 bench/gpu_check_mfu.py || status=1
echo
echo "== fp8: llama 1b in bf16 and in the GPU's fp8 policy, predicted vs measured step ratio, loss gap"
python3 bench/gpu_check_fp8.py || status=1
echo
echo "== serving: llama 1b planned for this GPU without the device vs served on it (TTFT, TPOT, peak)"
python3 bench/gpu_check_serving.py || status=1
python3 bench/gpu_check_serving.py --precision int8 --batches 1,32 || status=1
exit ${status:-0}
