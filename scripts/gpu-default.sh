#!/usr/bin/env bash
# Runs ON the GPU machine: a new default checked in one call. OLD_DIR and NEW_DIR hold a trainer (.xz or .gz);
# NEW_DIR also gpu-step-tests, gpu-kernel-tests and gpu-tests.
#   1. ab-bench.sh, bf16 batch 256, ROUNDS (default 2): OLD, NEW, and NEW with OFF_ENV (default
#      KERNELS_JOIN_IN_CONV=0: the new default turned off again);
#   2. scripts/bench-vs-torch.sh: NEW against PyTorch eager AMP channels-last, bf16 and fp16 at batch 256;
#   3. with KTRACE=DIR (ktrace.c, ktrace_report.py): a kernel timeline of NEW's default bf16 step;
#   4. NEW's gpu-step, gpu-kernel and gpu tests.
#   usage: bash scripts/gpu-default.sh OLD_DIR NEW_DIR
# Writes $OUT: bench-table.md, ktrace-new.txt, the test logs, ab.tgz (the bench logs).
set -uo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
old="${1:?usage: gpu-default.sh OLD_DIR NEW_DIR}" new="${2:?usage: gpu-default.sh OLD_DIR NEW_DIR}"
out="${OUT:-$PWD/gpu-out}"
mkdir -p "$out"
# shellcheck source=scripts/gpu-env.sh
source "$here/scripts/gpu-env.sh"
gpu_libs
b="$(mktemp -d /tmp/gpu-default.XXXXXX)"
mkdir -p "$b/old" "$b/new" "$b/ab"
unpack_bin "$old" "$b/old" trainer && unpack_bin "$new" "$b/new" trainer gpu-step-tests gpu-kernel-tests gpu-tests ||
    exit 2
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader
fails=0
echo "== 1. A/B bf16 ($SECONDS s)"
OUT="$b/ab" ROUNDS="${ROUNDS:-2}" bash "$here/scripts/ab-bench.sh" "old:$b/old/trainer" "new:$b/new/trainer" \
    "new-off:${OFF_ENV:-KERNELS_JOIN_IN_CONV=0} $b/new/trainer"
echo "== 2. against PyTorch ($SECONDS s)"
OUT="$out" timeout 240 bash "$here/scripts/bench-vs-torch.sh" "$b/new/trainer" resnet152 bf16,fp16 256 \
    > "$b/ab/bench-vs-torch.log" 2>&1 || fails=$((fails + 1))
tail -4 "$out/bench-table.md"
if [ -n "${KTRACE:-}" ]; then
    echo "== 3. ktrace, the default bf16 step ($SECONDS s)"
    if ktrace_lib "$KTRACE" "$b/libktrace.so"; then
        CUDA_INJECTION64_PATH="$b/libktrace.so" KTRACE_OUT="$b/trace.csv" timeout 150 "$b/new/trainer" bench \
            --config "$here/configs/resnet152.toml" --dtypes bf16 --batch-sizes 256 --warmup 3 --steps 5 \
            > "$b/ab/ktrace-bench.log" 2>&1
        python3 "$KTRACE/ktrace_report.py" "$b/trace.csv" --marker mt_sgd_f32 --steps 4 --top 30 \
            > "$out/ktrace-new.txt" 2>&1
        head -20 "$out/ktrace-new.txt"
    else
        echo "ktrace: build failed"
    fi
fi
echo "== 4. tests ($SECONDS s)"
for t in gpu-step-tests gpu-kernel-tests gpu-tests; do
    (cd "$b/new" && RUST_BACKTRACE=1 timeout 200 "./$t" --test-threads=1 --nocapture > "$out/$t.log" 2>&1) ||
        fails=$((fails + 1))
    echo "$t: $(grep -E "test result" "$out/$t.log" | tail -1)"
done
(cd "$b" && tar czf "$out/ab.tgz" ab)
rm -rf "$b"
echo "== gpu-default: $fails failure(s), $SECONDS s"
[ "$fails" -eq 0 ]
