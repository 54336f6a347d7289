#!/usr/bin/env bash
# Runs ON the GPU machine: the block-output join folded into the conv1 grad-inputs (`kernels.join_in_conv`), one
# call, correctness first:
#   1. the new build's gpu-step tests `joined_grad_input_matches_the_join` and `join_in_conv_step_matches_bit_for_bit`;
#   2. `trainer bench` A/B (scripts/ab-bench.sh, ResNet-152 bf16 batch 256, ROUNDS rounds, default 2): MAIN's
#      trainer (with MAIN_ON=1 also MAIN's with KERNELS_JOIN_IN_CONV=1), the new build with KERNELS_JOIN_IN_CONV=0
#      (the switch off; on by default since 7a6e428) and =1;
#   3. a kernel timeline of the new build with the switch on (KTRACE=DIR holding ktrace.c and ktrace_report.py);
#   4. the new build's other gpu-step tests and its gpu-kernel tests (ALL_TESTS=0 leaves them out).
#   usage: bash scripts/gpu-join.sh MAIN_DIR NEW_DIR     (each DIR holds trainer[.xz|.gz]; NEW_DIR also the tests)
# Writes $OUT/join.txt (the summary), the test logs and ab.tgz (the bench logs).
set -uo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
main="${1:?usage: gpu-join.sh MAIN_DIR NEW_DIR}" new="${2:?usage: gpu-join.sh MAIN_DIR NEW_DIR}"
out="${OUT:-$PWD/gpu-out}"
mkdir -p "$out"
sum="$out/join.txt"
# shellcheck source=scripts/gpu-env.sh
source "$here/scripts/gpu-env.sh"
gpu_libs
bin="$(mktemp -d /tmp/gpu-join.XXXXXX)"
mkdir -p "$bin/main" "$bin/new" "$bin/ab"
unpack_bin "$main" "$bin/main" trainer && unpack_bin "$new" "$bin/new" trainer gpu-step-tests gpu-kernel-tests || exit 2
fails=0
tests() {  # tests BINARY LOG ARGS...
    local b="$1" log="$2"
    shift 2
    (cd "$bin/new" && timeout "${TEST_TIMEOUT:-240}" "./$b" "$@" --test-threads=1 --nocapture > "$out/$log" 2>&1) ||
        fails=$((fails + 1))
    grep -E "^test |test result|^joined|^join_in_conv" "$out/$log" | cut -c1-220 | tee -a "$sum"
}
echo "== 1. the join tests" | tee -a "$sum"
tests gpu-step-tests step-join.log join
echo "== 2. A/B (bf16, batch 256)" | tee -a "$sum"
variants=("main:$bin/main/trainer")
[ "${MAIN_ON:-0}" != 1 ] || variants+=("main-on:KERNELS_JOIN_IN_CONV=1 $bin/main/trainer")
variants+=("off:KERNELS_JOIN_IN_CONV=0 $bin/new/trainer" "on:KERNELS_JOIN_IN_CONV=1 $bin/new/trainer")
OUT="$bin/ab" ROUNDS="${ROUNDS:-2}" bash "$here/scripts/ab-bench.sh" "${variants[@]}" 2>&1 | tee -a "$sum"
if [ -n "${KTRACE:-}" ]; then
    echo "== 3. ktrace, the switch on (bf16)" | tee -a "$sum"
    if ktrace_lib "$KTRACE" "$bin/libktrace.so"; then
        KERNELS_JOIN_IN_CONV=1 CUDA_INJECTION64_PATH="$bin/libktrace.so" KTRACE_OUT="$bin/trace.csv" timeout 150 \
            "$bin/new/trainer" bench --config "$here/configs/resnet152.toml" --dtypes bf16 --batch-sizes 256 \
            --warmup 3 --steps 5 > "$bin/ab/ktrace-bench.log" 2>&1
        python3 "$KTRACE/ktrace_report.py" "$bin/trace.csv" --marker mt_sgd_f32 --steps 4 --top 30 > "$out/ktrace-join.txt" 2>&1
        head -45 "$out/ktrace-join.txt" | tee -a "$sum"
    else
        echo "ktrace: build failed" | tee -a "$sum"
    fi
fi
if [ "${ALL_TESTS:-1}" = 1 ]; then
    echo "== 4. the other gpu-step tests and the gpu-kernel tests" | tee -a "$sum"
    tests gpu-step-tests step-all.log --skip join
    tests gpu-kernel-tests kernel-tests.log
fi
(cd "$bin" && tar czf "$out/ab.tgz" ab)
rm -rf "$bin"
echo "== gpu-join: $fails failure(s)" | tee -a "$sum"
[ "$fails" -eq 0 ]
