#!/usr/bin/env bash
# Runs ON the GPU machine: the checks and timings of the BatchNorm + ReLU inside the bottleneck conv3's 1x1 GEMM
# (KernelPolicy::bn_apply_in_conv, KERNELS_BN_APPLY_IN_CONV=both / backward) in one call, from target-gpurun/dist (trainer,
# gpu-step-tests and gpu-tests, .xz or .gz; scripts/prepare-gpurun.sh):
#   1. gpu-step-tests bn_relu_operand / bn_apply_in_conv (the kernels bit for bit against the materialised input
#      on every TMA tile; the ResNet-50 step bit for bit), then, with the switch on, the fused step against
#      autograd (ResNet-18/50/152, bf16/fp16) and the cooperative step tests;
#   2. gpu-tests cooperative (the statistics-only cooperative launch beside the others);
#   3. scripts/ab-bench.sh base / bninbwd (backward) / bnin (both), ROUNDS rounds (default 3), ResNet-152 bf16
#      batch 256.
# PART=tests or PART=ab runs one half. Logs under $OUT (default ./gpu-out).
set -uo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dist="${DIST:-$here/target-gpurun/dist}"
out="${OUT:-$PWD/gpu-out}"
mkdir -p "$out"
bin="$(mktemp -d /tmp/gpu-bnin.XXXXXX)"
# shellcheck source=scripts/gpu-env.sh
source "$here/scripts/gpu-env.sh"
unpack_bin "$dist" "$bin" trainer gpu-step-tests gpu-tests || exit 2
gpu_libs
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
cat "$dist/BUILD_INFO" 2>/dev/null | head -3
fails=0
t() {
    local log="$1" limit="$2" t0=$SECONDS
    shift 2
    if RUST_BACKTRACE=1 timeout "$limit" "$@" --nocapture --test-threads=1 > "$out/$log" 2>&1; then
        echo "$log: ok ($((SECONDS - t0)) s)"
    else
        echo "$log: FAILED ($((SECONDS - t0)) s)"
        fails=$((fails + 1))
    fi
    grep -E "^test |test result|bit for bit|panicked|Error|differs" "$out/$log" | head -40
}
if [ "${PART:-all}" != ab ]; then
    t bnin-tests.log 200 "$bin/gpu-step-tests" bn_relu_operand bn_apply_in_conv
    KERNELS_BN_APPLY_IN_CONV=both t bnin-step-tests.log 300 "$bin/gpu-step-tests" fused_step cooperative_batchnorm_step
    t coop-tests.log 120 "$bin/gpu-tests" cooperative
fi
if [ "${PART:-all}" != tests ]; then
    OUT="$out/ab" ROUNDS="${ROUNDS:-3}" bash "$here/scripts/ab-bench.sh" base:"$bin/trainer" \
        "bninbwd:KERNELS_BN_APPLY_IN_CONV=backward $bin/trainer" "bnin:KERNELS_BN_APPLY_IN_CONV=both $bin/trainer"
    tar -czf "$out/ab.tgz" -C "$out" ab && rm -rf "$out/ab"
fi
echo "gpu-bnin: $fails failed"
