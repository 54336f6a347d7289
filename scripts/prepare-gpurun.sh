#!/usr/bin/env bash
# Builds and assembles everything one call of scripts/gpu-step.sh needs on the GPU machine, in the git-ignored
# folder target-gpurun (name it in the device tool's `carry`; at most 64 MiB travel):
#   target-gpurun/dist/{trainer,gpu-step-tests,gpu-tests,dp-tests}.gz + BUILD_INFO   (an NCCL=1 build, ~60 MB;
#   GPURUN_FILES="trainer gpu-step-tests dp-tests kernels-bench" picks others; GPURUN_XZ=1 makes .xz files, ~half)
#   target-gpurun/ktrace/{ktrace.c,ktrace_report.py}   (from KTRACE_SRC, default ../shared/tools/ktrace, if there)
# Then, on the GPU machine, from the repository root (docs/BENCHMARKS.md lists what is owed):
#   GPU_TESTS_FILTER="..." NCCL_CHECK=1 DATA_E2E=1 KTRACE=$PWD/target-gpurun/ktrace \
#       bash scripts/gpu-step.sh target-gpurun/dist
# Run it from a shell without the wheel's nvcc on PATH (package-gpu.sh sets up its own).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
NCCL=1 DIST_MAX_MIB="${DIST_MAX_MIB:-300}" bash scripts/package-gpu.sh
rm -rf target-gpurun
mkdir -p target-gpurun/dist
# GPURUN_FILES: which of package-gpu.sh's binaries travel (all of them together exceed the carry limit).
# GPURUN_XZ=1: recompressed with xz (about half gzip's size: room for more binaries, or an older build beside
# these, in the carry limit; gpu-step.sh and ab-bench.sh's callers unpack either).
for f in ${GPURUN_FILES:-trainer gpu-step-tests gpu-tests dp-tests}; do
    if [ -n "${GPURUN_XZ:-}" ]; then
        gunzip -c "dist/$f.gz" | xz -9 -T0 > "target-gpurun/dist/$f.xz"
    else
        cp "dist/$f.gz" target-gpurun/dist/
    fi
done
cp dist/BUILD_INFO target-gpurun/dist/
src="${KTRACE_SRC:-../shared/tools/ktrace}"
if [ -f "$src/ktrace.c" ] && [ -f "$src/ktrace_report.py" ]; then
    mkdir -p target-gpurun/ktrace
    cp "$src/ktrace.c" "$src/ktrace_report.py" target-gpurun/ktrace/
else
    echo "prepare-gpurun: no ktrace sources in $src (KTRACE_SRC): the kernel timeline is left out" >&2
fi
size_kib="$(du -sk target-gpurun | cut -f1)"
echo "target-gpurun: $((size_kib / 1024)) MiB (carry limit 64)"
[ "$size_kib" -le $((64 * 1024)) ] || { echo "prepare-gpurun: over the 64 MiB carry limit" >&2; exit 1; }
