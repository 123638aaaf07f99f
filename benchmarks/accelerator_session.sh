#!/usr/bin/env bash
# One GPU session's measurements in one command (a lent GPU's time is short; this fits 600 s):
# bench_accelerator.py on the README's two GPU shapes, ours beside HF + torch, with the
# variants of the update, and a profile of our qwen2.5-1.5b update. Run from the repo's root on
# the GPU machine (jax with CUDA, flax, optax, chex, torch and transformers installed; the
# package is not installed there, hence PYTHONPATH):
#
#     OUT=/some/dir bash benchmarks/accelerator_session.sh          # GPU: logs and JSON in $OUT
#     TINY=1 OUT=/tmp/acc bash benchmarks/accelerator_session.sh    # CPU dry run, tiny shapes
#
# Each bench call has its own --budget (no part starts past it; a part still running then is
# killed and reported), so a slow part costs the parts after it in its call, never the next call.
set -u
OUT=${OUT:-/tmp/accelerator_session}
mkdir -p "$OUT"
export PYTHONPATH=.:benchmarks PYTHONUNBUFFERED=1
BENCH="python3 benchmarks/bench_accelerator.py"
if [ -n "${TINY:-}" ]; then
    BENCH="$BENCH --tiny"
    SMALL=(--preset cpu-tiny)
    BUDGET_A=${BUDGET_A:-120} BUDGET_B=${BUDGET_B:-60}
else
    SMALL=(--preset qwen2.5-1.5b)
    BUDGET_A=${BUDGET_A:-330} BUDGET_B=${BUDGET_B:-235}
fi
# The variants: cuDNN's attention with and without bf16 unembedding operands (bf16 alone is
# their difference), and both with remat keeping the matmuls' outputs (model.remat=dots).
BOTH="model.unembed_dtype=bfloat16 model.attention=cudnn"
{
    date -u
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv 2>/dev/null
    python3 -c "import jax, flax, optax, torch, transformers as t; print('jax', jax.__version__, 'flax', \
flax.__version__, 'optax', optax.__version__, 'torch', torch.__version__, 'transformers', t.__version__, jax.devices())"
    git log -1 --format='git %h %s' 2>/dev/null
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

$BENCH "${SMALL[@]}" --budget "$BUDGET_A" --profile --work /tmp/acc_small --json "$OUT/small.json" \
    --variant "$BOTH" --variant model.attention=cudnn --variant "$BOTH model.remat=dots" \
    2>&1 | tee "$OUT/small.log"

if [ -n "${TINY:-}" ]; then
    LARGE=(--preset cpu-tiny model.num_layers=1)
else  # the deepseekmath-rl-7b shape with 8 of its 30 layers, 16 micro-batches of 4 rows
    LARGE=(--preset deepseekmath-rl-7b model.num_layers=8 --group 16 --micro-batches 16)
fi
$BENCH "${LARGE[@]}" --budget "$BUDGET_B" --work /tmp/acc_large --json "$OUT/large.json" \
    --parts jax_update,torch_update,jax_rollout,torch_generate --variant "$BOTH model.remat=dots" \
    2>&1 | tee "$OUT/large.log"
