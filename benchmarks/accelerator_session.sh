#!/usr/bin/env bash
# One GPU session's measurements in one command (a lent GPU's time is short; this fits 600 s):
# bench_accelerator.py on the README's two GPU shapes, ours beside HF + torch, every row of the
# last session's table again as the baseline, with --profile (one more call each of our update
# and our rollout under jax's profiler: the update's kernels by part and pass, the decode split
# by part of its step). Run from the repo's root on the GPU machine (jax with CUDA, flax, optax,
# chex, torch and transformers installed; the package is not installed there, hence PYTHONPATH):
#
#     OUT=/some/dir bash benchmarks/accelerator_session.sh          # GPU: logs and JSON in $OUT
#     TINY=1 OUT=/tmp/acc bash benchmarks/accelerator_session.sh    # CPU dry run, tiny shapes
#
# PYTHON names the interpreter (default python3).
# Seven files in $OUT (the device tool brings back at most 8): env.txt, large.{json,log},
# small.{json,log}, slots.{json,log}. The 7B shape runs first: its update with the GPU's options
# has never been measured. The third call is the slot engine beside the static one on the same
# rows (bench_slots.py without its SmolLM2 workloads, whose weights the GPU machine lacks),
# stopped by `timeout` at its budget. Each bench call has its own --budget (no part starts past it; a part still running
# then is killed and reported), so a slow part costs the parts after it in its call, never the
# next call. The exit status is 0 when every part of both calls ran.
set -u
OUT=${OUT:-/tmp/accelerator_session}
mkdir -p "$OUT"
export PYTHONPATH=.:benchmarks PYTHONUNBUFFERED=1
PYTHON=${PYTHON:-python3}
BENCH="$PYTHON benchmarks/bench_accelerator.py --profile"
if [ -n "${TINY:-}" ]; then
    BENCH="$BENCH --tiny"
    # cuDNN's attention runs on a GPU only: the dry run takes the model's own in its place.
    ATTENTION=xla
    LARGE=(--preset cpu-tiny model.num_layers=1)
    SMALL=(--preset cpu-tiny)
    # Its children compile as long as a GPU's do, and a shared 2-core CPU may run them at a tenth
    # of its speed: caps, not estimates.
    BUDGET_LARGE=${BUDGET_LARGE:-900} BUDGET_SMALL=${BUDGET_SMALL:-1200} BUDGET_SLOTS=${BUDGET_SLOTS:-900}
else
    ATTENTION=cudnn
    # the deepseekmath-rl-7b shape with 8 of its 30 layers, 16 micro-batches of 4 rows
    LARGE=(--preset deepseekmath-rl-7b model.num_layers=8 --group 16 --micro-batches 16)
    SMALL=(--preset qwen2.5-1.5b)
    BUDGET_LARGE=${BUDGET_LARGE:-245} BUDGET_SMALL=${BUDGET_SMALL:-235} BUDGET_SLOTS=${BUDGET_SLOTS:-70}
fi
# The GPU's options: bf16 unembedding operands, cuDNN's fused attention, remat keeping the
# matmuls' outputs; the 1.5B table adds them one at a time.
BF16=model.unembed_dtype=bfloat16
GPU_OPTIONS="$BF16 model.attention=$ATTENTION model.remat=dots"
{
    date -u
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv 2>/dev/null
    $PYTHON -c "import jax, flax, optax, torch, transformers as t; print('jax', jax.__version__, 'flax', \
flax.__version__, 'optax', optax.__version__, 'torch', torch.__version__, 'transformers', t.__version__, jax.devices())"
    git log -1 --format='git %h %s' 2>/dev/null
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

status=0
$BENCH "${LARGE[@]}" --budget "$BUDGET_LARGE" --work /tmp/acc_large --json "$OUT/large.json" \
    --variant "$GPU_OPTIONS" 2>&1 | tee "$OUT/large.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

$BENCH "${SMALL[@]}" --budget "$BUDGET_SMALL" --work /tmp/acc_small --json "$OUT/small.json" \
    --variant "$BF16" --variant "$BF16 model.attention=$ATTENTION" --variant "$GPU_OPTIONS" \
    2>&1 | tee "$OUT/small.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

timeout "$BUDGET_SLOTS" $PYTHON benchmarks/bench_slots.py --skip-smollm2 --reps 1 --json "$OUT/slots.json" \
    2>&1 | tee "$OUT/slots.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
exit $status
