#!/usr/bin/env bash
# Times several builds of a dev harness (kernels/dev/batchnorm/bnbench.cu or kernels/dev/gemm/tmabench.cu) side by
# side: ROUNDS rounds, each running every build once in the order given, then a summary: each build's per-step
# milliseconds (each round's log from its first "per ResNet-152 step" heading to the end) and whether its
# output hashes equal the first build's (bit for bit; the hash words of gpu-env.sh's devbench_hashes). Runs
# on the GPU machine. Builds of the same harness with different -D switches, or from different revisions of the
# kernels (nvcc's -I another tree's kernels/), are the usual use, e.g.
#   nvcc -O3 -std=c++17 -arch=sm_90 -I kernels -DSWITCH=1 -o bnbench-sw kernels/dev/batchnorm/bnbench.cu
#   usage: bash scripts/bn-dev-variants.sh LABEL:BINARY [LABEL:BINARY ...]
# Env: ROUNDS (2), ARGS (the harness's arguments, e.g. the batch: 256), OUT (/tmp): the logs
# devbench-LABEL-R.txt and devbench-summary.txt.
set -uo pipefail
# shellcheck source=scripts/gpu-env.sh
source "$(dirname "${BASH_SOURCE[0]}")/gpu-env.sh"
[ $# -ge 1 ] || { echo "usage: bash scripts/bn-dev-variants.sh LABEL:BINARY [LABEL:BINARY ...]" >&2; exit 2; }
out=${OUT:-/tmp}
rounds=${ROUNDS:-2}
labels=()
for spec in "$@"; do
    label=${spec%%:*}
    bin=${spec#*:}
    [ -x "$bin" ] || { echo "bn-dev-variants: $bin (build $label) is not an executable file" >&2; exit 2; }
    labels+=("$label")
done
for r in $(seq 1 "$rounds"); do
    for spec in "$@"; do
        label=${spec%%:*}
        bin=${spec#*:}
        # shellcheck disable=SC2086
        "$bin" ${ARGS:-} > "$out/devbench-$label-$r.txt" 2>&1 || echo "build $label round $r failed (exit $?)" >&2
    done
done
summary=$out/devbench-summary.txt
{
    first=${labels[0]}
    for label in "${labels[@]}"; do
        echo "== $label"
        if [ "$label" != "$first" ]; then
            if diff <(devbench_hashes "$out/devbench-$first-1.txt") <(devbench_hashes "$out/devbench-$label-1.txt") > /dev/null; then
                echo "hashes: same as $first"
            else
                echo "hashes: DIFFER from $first"
            fi
        fi
        for r in $(seq 1 "$rounds"); do
            # The per-step block: from its heading to the end of the log.
            echo "-- round $r"
            awk '/^per .*step/{on = 1} on' "$out/devbench-$label-$r.txt"
        done
    done
} > "$summary"
cat "$summary"
