#!/usr/bin/env bash
# What only a GPU can check, in stages that each fit a 10-minute slot on a lent GPU machine
# (see ../shared/gpu/README.md for .whl/, the wheels a GPU image lacks):
#
#   bash scripts/gpu-check.sh tests   # pytest -m gpu: NCCL, bf16 FSDP2, QLoRA on CUDA, Liger, OOM faults
#   bash scripts/gpu-check.sh shard   # benchmarks/bench_shard.py: peak memory and tokens/s, 8B shape
#   bash scripts/gpu-check.sh speed   # benchmarks/bench_gpu.py: tokens/s against HF Trainer + peft
#
# Everything goes to $OUT (the device tool's folder that comes back), or ./gpu-check where it is unset:
# the output of each stage, its JSON where it has one, nvidia-smi and the package versions.
set -u
stage=${1:?usage: bash scripts/gpu-check.sh tests|shard|speed}
out=${OUT:-gpu-check}
mkdir -p "$out"
if [ -d .whl ] && ! python3 -c "import ipyparallel" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi > "$out/nvidia-smi.txt" 2>&1 || echo "no nvidia-smi: is this a GPU machine?" >&2
python3 - > "$out/versions.txt" 2>&1 <<'EOF'
import importlib
for name in ("torch", "transformers", "peft", "bitsandbytes", "liger_kernel", "ipyparallel"):
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
  *)
    echo "unknown stage $stage: use tests, shard or speed" >&2
    exit 2
    ;;
esac
