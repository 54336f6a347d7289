#!/usr/bin/env bash
# One GPU call: the GPU test suite, then ResNet-152 training throughput of this project against PyTorch eager AMP
# (same run, same GPU), then candle's own conv backward as the baseline. Runs on the GPU machine with dist/ carried.
#   bash scripts/gpu-bench.sh [dist]        logs under $OUT
# Knobs: SWEEP=1 (then sweep --max within TIME_BUDGET_S), SKIP_TESTS=1, DTYPES=fp32,bf16,fp16, SIZES=64,128,256, BENCH_WARMUP, BENCH_STEPS, BASELINE_SIZES=64.
set -uo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
dist="$(cd "${1:-dist}" && pwd)"
out="${OUT:-/tmp/gpu-out}"
mkdir -p "$out"
fails=0
if [ "${SKIP_TESTS:-0}" != 1 ]; then
    SANITIZE="${SANITIZE:-0}" bash "$here/gpu-test.sh" "$dist" || fails=$((fails + 1))
fi
bin="$(mktemp -d /tmp/gpu-bench.XXXXXX)"
# shellcheck source=scripts/gpu-env.sh
source "$here/gpu-env.sh"
unpack_bin "$dist" "$bin" trainer || exit 2
gpu_libs
echo "== bench vs PyTorch: resnet152 ${DTYPES:-fp32,bf16,fp16} x ${SIZES:-64,128,256}"
OUT="$out" bash "$here/bench-vs-torch.sh" "$bin/trainer" resnet152 "${DTYPES:-fp32,bf16,fp16}" "${SIZES:-64,128,256}" || fails=$((fails + 1))
if [ -n "${BASELINE_SIZES:-64}" ]; then
    echo "== baseline: candle's conv backward (kernels.conv=candle), bf16"
    "$bin/trainer" bench --config "$here/../configs/resnet152.toml" --set kernels.conv=candle --dtypes bf16 \
        --batch-sizes "${BASELINE_SIZES:-64}" --warmup 2 --steps 3 2>&1 | tee "$out/bench-candle-baseline.log"
fi
budget=${TIME_BUDGET_S:-0}
if [ "${SWEEP:-0}" = 1 ]; then
    left=$(( budget > 0 ? budget - SECONDS : 600 ))
    if [ "$left" -gt 60 ]; then
        echo "== sweep --max (bf16, from ${SWEEP_START:-256}, granularity ${SWEEP_GRAN:-128}; ${left} s left)"
        timeout "$left" "$bin/trainer" sweep --config "$here/../configs/resnet152.toml" --max \
            --batch-sizes "${SWEEP_START:-256}" --granularity "${SWEEP_GRAN:-128}" --warmup 1 --steps 2 \
            --out "$out/sweep" 2>&1 | tee "$out/sweep.log"
    else
        echo "== sweep skipped: ${left} s left"
    fi
fi
rm -rf "$bin"
echo "== gpu-bench: $fails failure(s)"
[ "$fails" -eq 0 ]
