#!/usr/bin/env bash
# One GPU call for the kernels crate (runs ON the GPU machine with dist/ carried; logs under $OUT):
#   1. the kernel tests (gpu-kernel-tests: conv on the 23 ResNet-152 shapes + awkward ones, matmul, autograd),
#   2. the rest of the GPU suite (gpu-tests: pools incl. NHWC, ResNets on CUDA vs CPU),
#   3. scripts/kernels-bench.sh: per-shape TFLOP/s ours / candle / cuDNN and matmul vs cuBLAS,
#   4. ResNet-152 training img/s on the default kernels ("auto": the custom ones on CUDA in bf16/fp16) vs the
#      fwdconv path vs PyTorch eager AMP channels-last in the same invocation (scripts/bench-vs-torch.sh), and the
#      step's phases (bench --phases).
#   usage: bash scripts/gpu-kernels.sh [DIST_DIR]
# Knobs: DTYPES (bf16), SIZES (128,256), BASELINE=0 skips the fwdconv run, SKIP_TESTS=1, SKIP_KB=1 skips
# the kernels bench, KB_ARGS.
set -uo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
dist="$(cd "${1:-dist}" && pwd)" || exit 2
out="${OUT:-$PWD/gpu-out}"
mkdir -p "$out"
# shellcheck source=scripts/gpu-env.sh
source "$here/gpu-env.sh"
gpu_libs
bin="$(mktemp -d /tmp/gpu-kernels.XXXXXX)"
unpack_bin "$dist" "$bin" trainer gpu-tests gpu-kernel-tests || exit 2
fails=0
cat "$dist/BUILD_INFO"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
if [ "${SKIP_TESTS:-0}" != 1 ]; then
    for t in gpu-kernel-tests gpu-tests; do
        echo "== $t"
        if timeout 400 "$bin/$t" --nocapture > "$out/$t.log" 2>&1; then
            grep -E "^test |test result" "$out/$t.log"
        else
            grep -E "^test |test result|Error:|panicked" "$out/$t.log" | head -30; echo "$t: FAILED"; fails=$((fails + 1))
        fi
    done
fi
if [ "${SKIP_KB:-0}" != 1 ]; then
    echo "== kernels bench"
    KB_ARGS="${KB_ARGS:---variants}" bash "$here/kernels-bench.sh" "$dist" 128 bf16 > "$out/kernels-bench.log" 2>&1 \
        || fails=$((fails + 1))
    sed -n '/ResNet-152 convs, batch/,$p' "$out/kernels-bench.log" | tail -35
fi
echo "== ResNet-152 training: default kernels (auto = custom) vs PyTorch"
OUT="$out" bash "$here/bench-vs-torch.sh" "$bin/trainer" resnet152 "${DTYPES:-bf16}" "${SIZES:-128,256}" \
    > "$out/bench-custom.log" 2>&1 || fails=$((fails + 1))
tail -6 "$out/bench-custom.log"
echo "== ResNet-152 step phases (custom kernels, bf16, batch 128; device synchronized between phases)"
"$bin/trainer" bench --config "$here/../configs/resnet152.toml" --dtypes bf16 --batch-sizes 128 --warmup 2 --steps 5 \
    --phases > "$out/bench-phases.log" 2>&1 || fails=$((fails + 1))
grep -E "^resnet|phases" "$out/bench-phases.log" | tail -2
if [ "${BASELINE:-1}" = 1 ]; then
    echo "== same, candle's convolution (kernels.conv=fwdconv, cuBLAS), batch 128"
    "$bin/trainer" bench --config "$here/../configs/resnet152.toml" --dtypes "${DTYPES:-bf16}" --batch-sizes 128 \
        --warmup 2 --steps 5 --set kernels.conv=fwdconv --set kernels.matmul=cublas > "$out/bench-default.log" 2>&1 || fails=$((fails + 1))
    grep -E "img/s|BENCH_JSON" "$out/bench-default.log" | tail -3
fi
echo "== trainer end to end with the custom kernels: ResNet-152 bf16, loader, 4 steps, validation, checkpoint"
e2e="$(mktemp -d /tmp/e2e.XXXXXX)"
if "$bin/trainer" --config "$here/../configs/resnet152.toml" --run-dir "$e2e/run" --set data.kind=synthetic \
    --set data.num_samples=256 --set train.batch_size=64 --set train.epochs=1 --set log.every_steps=1 \
    --set log.progress=false \
    --set kernels.autotune_cache="$out/autotune.tsv" > "$out/e2e-custom.log" 2>&1 \
    && [ -f "$e2e/run/checkpoints/best.safetensors" ]; then
    grep -E "^epoch|^done" "$out/e2e-custom.log"; echo "autotuned choices: $(wc -l < "$out/autotune.tsv")"
    echo "trainer e2e (custom kernels): ok"
else
    tail -20 "$out/e2e-custom.log"; echo "trainer e2e (custom kernels): FAILED"; fails=$((fails + 1))
fi
rm -rf "$e2e" "$bin"
echo "== gpu-kernels: $fails failure(s)"
[ "$fails" -eq 0 ]
