#!/usr/bin/env bash
# Build the CUDA binaries HERE (no GPU needed) and pack them for the GPU machine:
#   dist/trainer.gz    release `trainer` with --features cuda, stripped
#   dist/gpu-tests.gz  the tests/tests/gpu.rs test binary (cargo test --release --features cuda --test gpu)
#   dist/gpu-kernel-tests.gz  the tests/tests/gpu_kernels.rs test binary (conv/matmul kernels vs references)
#   dist/gpu-step-tests.gz    the tests/tests/gpu_step.rs test binary (the fused training step vs autograd)
#   dist/kernels-bench.gz     the kernel benchmark (crates/trainer/src/bin/kernels-bench.rs)
#   dist/BUILD_INFO    commit, date and toolchain of the build
# Then run `bash scripts/gpu-test.sh` on the GPU machine with dist/ carried along (docs/CUDA_BUILD.md).
# Uses CARGO_TARGET_DIR=target-cuda unless set: a cold build takes ~9+ minutes on 2 cores (candle-kernels).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
repo="$PWD"
# shellcheck source=scripts/setup-cuda.sh
source scripts/setup-cuda.sh
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$repo/target-cuda}"
max_mib="${DIST_MAX_MIB:-60}"

# NCCL=1: the trainer with the `nccl` feature (data-parallel collectives; needs libnccl.so.2 on the GPU machine).
features=cuda
[ "${NCCL:-0}" = 1 ] && features=nccl
echo "== cargo build --release -p trainer --features $features (trainer, kernels-bench)"
cargo build --release -p trainer --features "$features"
# Kept aside now: the test builds below (--features cuda) build the trainer package's binaries again, without
# NCCL, over these paths (the 2026-12-05 H200 call found its NCCL=1 trainer built without NCCL).
built="$CARGO_TARGET_DIR/gpu-package"
mkdir -p "$built"
cp "$CARGO_TARGET_DIR/release/trainer" "$CARGO_TARGET_DIR/release/kernels-bench" "$built/"


# test_bin NAME [PACKAGE]: path of the test binary NAME of PACKAGE (default integration-tests) built with the
# cuda feature.
test_bin() {
    cargo test --release --features cuda -p "${2:-integration-tests}" --test "$1" --no-run --message-format=json \
        | python3 -c '
import json, sys
name = sys.argv[1]
exe = [m["executable"] for m in map(json.loads, sys.stdin)
       if m.get("reason") == "compiler-artifact" and m["target"]["name"] == name and m.get("executable")]
print(exe[-1] if exe else "")' "$1"
}
echo "== cargo test --release --features cuda -p integration-tests --test gpu --test gpu_kernels --test gpu_step --no-run"
tests_bin="$(test_bin gpu)"
kernel_tests_bin="$(test_bin gpu_kernels)"
step_tests_bin="$(test_bin gpu_step)"
echo "== cargo test --release --features cuda -p trainer --test data_parallel --no-run"
dp_tests_bin="$(test_bin data_parallel trainer)"
for b in "$tests_bin" "$kernel_tests_bin" "$step_tests_bin" "$dp_tests_bin"; do
    [ -n "$b" ] && [ -x "$b" ] || { echo "package-gpu: GPU test binary not found" >&2; exit 1; }
done

rm -rf dist
mkdir -p dist
pack() { # pack SRC NAME: strip a copy of SRC into dist/NAME, gzip it
    strip -o "dist/$2" "$1"
    gzip -9 -f "dist/$2"
    echo "dist/$2.gz: $(du -h "$1" | cut -f1) unstripped -> $(du -h "dist/$2.gz" | cut -f1)"
}
pack "$built/trainer" trainer
pack "$tests_bin" gpu-tests
pack "$kernel_tests_bin" gpu-kernel-tests
pack "$step_tests_bin" gpu-step-tests
pack "$dp_tests_bin" dp-tests
pack "$built/kernels-bench" kernels-bench
{
    echo "commit: $(git rev-parse HEAD)$(git diff --quiet HEAD -- . ':!dist' 2>/dev/null || echo ' (with uncommitted changes)')"
    echo "built: $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(uname -m)"
    echo "rustc: $(rustc --version)"
    echo "nvcc: $(nvcc --version | tail -1)"
    echo "CUDA_COMPUTE_CAP: $CUDA_COMPUTE_CAP"
} > dist/BUILD_INFO
cat dist/BUILD_INFO

total_kib="$(du -sk dist | cut -f1)"
echo "dist/: $((total_kib / 1024)) MiB"
if [ "$total_kib" -gt $((max_mib * 1024)) ]; then
    echo "package-gpu: dist/ is over $max_mib MiB; the device tool carries at most 64 MiB with the repo" >&2
    exit 1
fi
