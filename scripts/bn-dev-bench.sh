#!/usr/bin/env bash
# Times the cooperative BatchNorm kernels of kernels/batchnorm/02_nhwc_vec.cu on ResNet-152's shapes with the
# standalone harness kernels/dev/batchnorm/bnbench.cu, for two builds side by side (alternating rounds), and checks
# that their outputs hash the same (bit for bit). Runs on the GPU machine. The same works for the TMA GEMM
# epilogue harness kernels/dev/gemm/tmabench.cu (two builds of it; BATCH is its one argument too): the hash check
# takes, on every shape line (l1 .. l4), the first four words and every 16-digit hex word.
#   usage: bash scripts/bn-dev-bench.sh NEW_BIN OLD_BIN [BATCH]
# Build the binaries where nvcc is (the wheel's nvcc here; -L its lib folder for cudart_static), e.g.
#   nvcc -O3 -std=c++17 -arch=sm_90 -I kernels -o bnbench-new kernels/dev/batchnorm/bnbench.cu
# and OLD_BIN the same from a copy of kernels/ holding the other revision of batchnorm/02_nhwc_vec.cu.
# Env: ROUNDS (2), OUT (/tmp): one log per run, bnbench-{new,old}-R.txt, and bnbench-hashes.txt (same / DIFFER).
set -uo pipefail
# shellcheck source=scripts/gpu-env.sh
source "$(dirname "${BASH_SOURCE[0]}")/gpu-env.sh"
new=${1:?new binary}
old=${2:?old binary}
batch=${3:-256}
out=${OUT:-/tmp}
for r in $(seq 1 "${ROUNDS:-2}"); do
    for v in old new; do
        bin=$old
        [ "$v" = new ] && bin=$new
        "$bin" "$batch" > "$out/bnbench-$v-$r.txt" 2>&1 || echo "bnbench $v round $r failed" >&2
        echo "== $v round $r"
        cat "$out/bnbench-$v-$r.txt"
    done
done
# Bit for bit: the hash columns of the first rounds.
if diff <(devbench_hashes "$out/bnbench-old-1.txt") <(devbench_hashes "$out/bnbench-new-1.txt") > "$out/bnbench-hashes.txt"; then
    echo "hashes: same (old and new bit for bit)" | tee -a "$out/bnbench-hashes.txt"
else
    echo "hashes: DIFFER" | tee -a "$out/bnbench-hashes.txt"
fi
