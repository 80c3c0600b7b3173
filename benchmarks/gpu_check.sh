#!/usr/bin/env bash
# One GPU machine call (world 1, NCCL, the image's torch, no install): the CUDA tests,
# then issues 27's and 28's measurements. 150m at 4 x 512 is the host-bound step; 880m at
# 4 x 2048 the compute-bound one; 880m at 1 x 2048 a step whose peak is in the backward;
# 4b at 4 x 2048 a model whose FSDP2 state alone (16 B/param) nears an 80 GB H100.
# "host" is issue 27's CPU criterion on that machine's 16 cores (gloo, tiny preset): on a
# 2-vCPU machine two ranks' main and gloo threads share the CPUs, and world 2 measures that.
# Every log line also lands in $OUT/gpu.log.
# Run from the checkout's root:
#   bash benchmarks/gpu_check.sh [tests|bench|memory|overlap|bwd-peak|large|profile|host ...]
set -u
export PYTHONPATH=$(ls -d packages/*/src | tr '\n' ':')src
export PYTHONUNBUFFERED=1
out=${OUT:-/tmp}
parts=${*:-tests bench memory profile}
exec > >(tee -a "$out/gpu.log") 2>&1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
git log -1 --format='main at %h %s' 2>/dev/null
bench="python3 -m mf.bench.cli --device cuda --world 1 --precision bf16 --optimizers adamw"
for part in $parts; do
  case $part in
    tests)
      timeout 150 python3 -m pytest -p no:benchmark -q -x tests/fsdp/engine/test_devices.py ${TESTS_K:+-k "$TESTS_K"} ;;
    bench)  # the host-bound step
      $bench --presets 150m --micro-batch 4 --seq-len 512 --rounds ${ROUNDS:-2} --steps 20 --warmup 5 \
        --engines plain,ddp,fsdp2,mf-zero3,mf-zero0 --json "$out/bench-150m.json" ;;
    memory)  # the compute-bound step, with issue 28's options beside FSDP2's
      $bench --presets 880m --micro-batch 4 --seq-len 2048 --rounds 1 --steps 8 --warmup 3 \
        --engines ${ENGINES_880M:-plain,fsdp2,fsdp2-offload,mf-zero3,mf-zero3-bwd-step,mf-zero3-offload,mf-zero3-offload-bwd-step} \
        --json "$out/bench-880m.json" ;;
    overlap)  # host-side state, its steps in the backward on a worker thread, beside FSDP2
      timeout 200 $bench --presets 880m --micro-batch 4 --seq-len 2048 --rounds 1 --steps 8 \
        --warmup 3 --no-reference --engines fsdp2,mf-zero3-offload,mf-zero3-offload-bwd-step \
        --json "$out/bench-880m-overlap.json" ;;
    bwd-peak)  # one sequence: the peak falls in the backward, where the in-backward step frees
      timeout 150 $bench --presets 880m --micro-batch 1 --seq-len 2048 --rounds 1 --steps 6 \
        --warmup 2 --no-reference --engines fsdp2,mf-zero3,mf-zero3-bwd-step \
        --json "$out/bench-880m-b1.json" ;;
    large)  # built on the meta device: no full fp32 copy on the GPU before sharding
      timeout ${LARGE_TIMEOUT:-330} $bench --presets 4b --micro-batch ${LARGE_BATCH:-8} --seq-len 2048 \
        --rounds 1 --steps 3 --warmup 1 --no-reference --meta-init \
        --engines ${ENGINES_4B:-fsdp2,mf-zero3-offload,mf-zero3-offload-bwd-step} \
        --json "$out/bench-4b.json" ;;
    host)  # CPU ms per step against plain PyTorch, world 1 and 2, no GPU involved
      for world in 1 2; do
        CUDA_VISIBLE_DEVICES= timeout 150 python3 benchmarks/host_cost.py --world $world \
          --steps ${HOST_STEPS:-200} --engines plain,comm-floor,ddp,fsdp2,mf-zero3
      done ;;
    profile)
      for engine in ${PROFILE_ENGINES:-mf-zero3}; do
        python3 benchmarks/step_profile.py --device cuda --engine $engine --preset 150m \
          --micro-batch 4 --seq-len 512 --steps 5 --top 30
      done ;;
  esac
done
