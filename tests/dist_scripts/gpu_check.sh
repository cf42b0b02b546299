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
# trainer level: 2 iterations of `shifu ppo` on the char task with FSDP2 (NCCL when 2+ GPUs), device=cuda
PYTHONPATH=tests:.${PYTHONPATH:+:$PYTHONPATH} $PY -c "
import pathlib, ppo_task
d = pathlib.Path('$OUT_DIR/ppo'); d.mkdir(parents=True, exist_ok=True)
ppo_task.build_char_model(d / 'model'); ppo_task.write_prompts(d / 'p.jsonl')"
STRATEGY=$([ "$N" -gt 1 ] && echo fsdp2 || echo none)
PYTHONPATH=tests:.${PYTHONPATH:+:$PYTHONPATH} SHIFU_THREADS=4 OMP_NUM_THREADS=4 \
  $PY -m torch.distributed.run --standalone --nproc_per_node "$N" -m shifu ppo \
  out_dir="$OUT_DIR/ppo/run" actor_path="$OUT_DIR/ppo/model" data.prompts="$OUT_DIR/ppo/p.jsonl" \
  reward.function=ppo_task:frac_a critic.init=sft device=cuda bf16=true iterations=2 batch_size=8 \
  minibatch_size=4 generation.max_new_tokens=8 eval.every=1 save_every=1 distributed.strategy=$STRATEGY \
  --overwrite
test -f "$OUT_DIR/ppo/run/final/model.safetensors" && echo "[ok] shifu ppo on cuda ($STRATEGY, $N ranks)"
