#!/usr/bin/env bash
# The GPU checks in one go, on a machine with a CUDA GPU and vlcurate importable:
#   bash tests/benchmarks/gpu_checks.sh [OUT_DIR] [IMAGES_DIR]
# 1. the tests whose `device` / `cuda` cases run only where torch sees a GPU (the mining pass in
#    fp32, bf16 and int8 against the CPU and the naive references, exact HPM, the hpm stage on cuda
#    against the CPU, the losses, the encoders, the teacher, GPU stages on Ray's actor pools);
# 2. bench_mining.py on the GPU: 1M clustered synthetic pairs (fp32, bf16 and int8) and the real-derived
#    65k set (needs its cached MiniLM vectors or ../shared/data);
# 3. bench_gpu_models.py: the pipeline's models at their real sizes (deploy/SIZING.md's GPU rates).
# Each step has its own time limit; their outputs go to OUT_DIR (default gpu-checks/).
set -u
out=${1:-gpu-checks}
images=${2:-}
py=${PYTHON:-python3}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee "$out/gpu.txt"
timeout 240 $py -m pytest -q -p no:cacheprovider -k "cuda or gpu" \
    tests/stages/mining/test_screen.py tests/stages/mining/test_blocks.py \
    tests/stages/mining/test_hpm.py tests/stages/mining/test_stage.py \
    tests/stages/mining/test_spaces.py \
    tests/trainer/test_losses.py tests/stages/test_embed.py tests/pipeline/test_ray.py \
    tests/pipeline/test_determinism.py \
    2>&1 | tee "$out/tests.txt"
timeout 450 $py tests/benchmarks/bench_mining.py --device cuda --set synth --n 1000000 \
    --targets 200000 --chunk 8192 --precisions fp32 bf16 int8 --ks 10 50 100 2>&1 | tee "$out/mining.txt"
timeout 90 $py tests/benchmarks/bench_mining.py --device cuda --set real --chunk 8192 \
    --precisions fp32 bf16 int8 --ks 10 50 100 2>&1 | tee -a "$out/mining.txt"
timeout 240 $py tests/benchmarks/bench_gpu_models.py --device cuda ${images:+--images "$images"} \
    2>&1 | tee "$out/models.txt"
