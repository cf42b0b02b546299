#!/usr/bin/env bash
# GPU-only paths of shifu.distributed, checked briefly on a CUDA machine (never in CI):
#   NCCL collectives, DDP and FSDP2 updates equal to 1 process, DCP resume, LoRA reference under FSDP2,
#   the synced uneven loop, FSDP2 with bf16 compute, and offload_frozen (CPU <-> GPU).
# 2 ranks when 2+ GPUs are visible, else 1. Usage: tests/dist_scripts/gpu_check.sh [OUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
OUT_DIR=${1:-${OUT:-/tmp/shifu-gpu-check}}
N=$($PY -c "import torch; print(min(2, torch.cuda.device_count()))")
if [ "$N" -lt 1 ]; then echo "no CUDA device: nothing to check"; exit 1; fi
$PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0), 'nccl', torch.cuda.nccl.version())"
echo "ranks: $N"
PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} SHIFU_THREADS=4 OMP_NUM_THREADS=4 \
  $PY -m torch.distributed.run --standalone --nproc_per_node "$N" \
  tests/dist_scripts/check_dist.py --out "$OUT_DIR" --bf16
