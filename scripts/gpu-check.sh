#!/usr/bin/env bash
# What only a GPU can check, in stages that each fit a 10-minute slot on a lent GPU machine
# (see ../shared/gpu/README.md for .whl/, the wheels a GPU image lacks):
#
#   bash scripts/gpu-check.sh tests   # pytest -m gpu: NCCL, bf16 FSDP2, QLoRA on CUDA, Liger, OOM faults
#   bash scripts/gpu-check.sh shard   # benchmarks/bench_shard.py: peak memory and tokens/s, 8B shape
#   bash scripts/gpu-check.sh speed   # benchmarks/bench_gpu.py: tokens/s against HF Trainer + peft
#   bash scripts/gpu-check.sh vllm-generate  # bench_generate.py --vllm --gpu: engine="vllm" vs "hf"
#   bash scripts/gpu-check.sh vllm-grpo      # bench_grpo.py --vllm --gpu: GRPO steps/s, vllm vs hf
#
# The vllm stages (issue 37) run on one GPU rank, a 0.52B-parameter Llama built from a config, and
# record each engine's GPU memory (the rank's process and vLLM's, from nvidia-smi). They need vLLM's
# CUDA build in the image, matching its torch; where it cannot be imported they say so and measure
# nothing. Their JSON goes to $OUT; to put it into benchmarks/RESULTS.md afterwards, on any machine:
#   cd benchmarks && python -c "import json, pathlib, bench_grpo as b; b.render_vllm(json.load(open('F')), pathlib.Path('RESULTS.md'))"
#   (bench_generate likewise, for the generate JSON)
#
# Everything goes to $OUT (the device tool's folder that comes back), or ./gpu-check where it is unset:
# the output of each stage, its JSON where it has one, nvidia-smi and the package versions.
set -u
stage=${1:?usage: bash scripts/gpu-check.sh tests|shard|speed|vllm-generate|vllm-grpo}
out=${OUT:-gpu-check}
mkdir -p "$out"
if [ -d .whl ] && ! python3 -c "import ipyparallel" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi > "$out/nvidia-smi.txt" 2>&1 || echo "no nvidia-smi: is this a GPU machine?" >&2
python3 - > "$out/versions.txt" 2>&1 <<'EOF'
import importlib
for name in ("torch", "transformers", "peft", "bitsandbytes", "liger_kernel", "ipyparallel", "vllm"):
    try:
        print(name, getattr(importlib.import_module(name), "__version__", "?"))
    except Exception as e:  # noqa: BLE001
        print(name, "MISSING:", type(e).__name__, e)
EOF
case "$stage" in
  tests)
    # -rs: every skip with its reason (a missing bitsandbytes or liger-kernel shows here)
    python3 -m pytest -q -rs -m gpu tests/ 2>&1 | tee "$out/pytest-gpu.txt" | tail -40
    ;;
  shard)
    python3 benchmarks/bench_shard.py --json "$out/shard.json" 2>&1 | tee "$out/bench_shard.txt" | tail -40
    ;;
  speed)
    python3 benchmarks/bench_gpu.py --json "$out/gpu.json" 2>&1 | tee "$out/bench_gpu.txt" | tail -40
    ;;
  vllm-generate|vllm-grpo)
    if ! python3 -c "import vllm" > "$out/vllm-import.txt" 2>&1; then
      echo "vLLM cannot be imported on this machine ($(tail -1 "$out/vllm-import.txt")): install" \
        "nbtrain[vllm] (vLLM's CUDA build, matching the image's torch) first; nothing measured" |
        tee "$out/vllm-skipped.txt"
      exit 3
    fi
    if [ "$stage" = vllm-generate ]; then
      # 64 prompts x 64 new tokens, greedy, both engines warm; about 3 min with the model's build
      timeout 540 python3 benchmarks/bench_generate.py --vllm --gpu --rounds 5 \
        --out "$out/generate-vllm-gpu.json" 2>&1 | tee "$out/bench_generate_vllm.txt" | tail -30
    else
      # 1 GPU: collocated only (two ranks do not share a GPU); 64 new tokens a completion
      timeout 540 python3 benchmarks/bench_grpo.py --vllm --gpu --reps 2 --steps 10 --warmup 3 \
        --out "$out/grpo-vllm-gpu.json" 2>&1 | tee "$out/bench_grpo_vllm.txt" | tail -30
    fi
    ;;
  *)
    echo "unknown stage $stage: use tests, shard, speed, vllm-generate or vllm-grpo" >&2
    exit 2
    ;;
esac
