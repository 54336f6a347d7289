#!/usr/bin/env bash
# Runs ON the GPU machine: does a run with the BatchNorm epilogues change the tiles a later default run takes?
# For each build, on a fresh autotune file of its own: first `trainer bench` with FIRST_SET (default
# kernels.bn_stats="fused") in bf16, then the default bench in bf16 and fp16 reading the file that run filled.
# Before 7e11870 the epilogue passes shared the plain passes' keys, so the default bf16 run inherited cp.async
# convolution picks (H200, 2026-12-06: bf16 3,438.8 img/s against fp16's 3,664.3); with the separate keys the
# default runs should tune their own and bf16 come out level with fp16 or ahead.
#   usage: bash scripts/autotune-order.sh LABEL:DIR [LABEL:DIR ...]   (DIR holds trainer[.xz|.gz])
# Prints each run's table row and, per file, how many convolution picks are cp.async (w*/t*) and how many TMA
# (x*); writes $OUT/LABEL-first.log, LABEL-default.log and LABEL-autotune.tsv (three files a build).
set -uo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
[ $# -ge 1 ] || { echo "usage: autotune-order.sh LABEL:DIR [LABEL:DIR ...]" >&2; exit 2; }
out="${OUT:-$PWD/gpu-out}"
mkdir -p "$out"
# shellcheck source=scripts/gpu-env.sh
source "$here/scripts/gpu-env.sh"
gpu_libs
work="$(mktemp -d /tmp/autotune-order.XXXXXX)"
first_set="${FIRST_SET:-kernels.bn_stats=\"fused\"}"
fails=0
# bench ARGS...: the current label's trainer bench (label, work and XDG_CACHE_HOME set by the loop below).
bench() {
    timeout "${BENCH_TIMEOUT:-120}" "$work/$label/bin/trainer" bench --config "$here/configs/resnet152.toml" \
        --batch-sizes "${BATCH:-256}" --warmup 3 --steps 10 "$@"
}
for spec in "$@"; do
    label="${spec%%:*}" dir="${spec#*:}"
    mkdir -p "$work/$label/bin"
    unpack_bin "$dir" "$work/$label/bin" trainer || { fails=$((fails + 1)); continue; }
    # A fresh autotune file (kernels.autotune_cache = "auto" puts it under XDG_CACHE_HOME).
    export XDG_CACHE_HOME="$work/$label/cache"
    bench --set "$first_set" --dtypes bf16 > "$out/$label-first.log" 2>&1 || echo "$label: the first run failed"
    bench --dtypes bf16,fp16 > "$out/$label-default.log" 2>&1 || echo "$label: the default run failed"
    echo "== $label: first (--set $first_set), then the default"
    grep -h -E "^resnet152 " "$out/$label-first.log" "$out/$label-default.log" || fails=$((fails + 1))
    tsv="$XDG_CACHE_HOME/resnet-train/kernels-autotune.tsv"
    if [ -f "$tsv" ]; then
        cp "$tsv" "$out/$label-autotune.tsv"
        # Convolution picks: the third field names the tile (x256/x128/x64 TMA; w*/t* cp.async).
        awk -F'\t' -v l="$label" '$2 ~ /^conv2d_nhwc/ { if ($3 ~ /^x/) tma++; else if ($3 ~ /^[wt]/) cp++ }
            END { printf "%s: convolution picks: %d TMA, %d cp.async\n", l, tma, cp }' "$tsv"
    else
        echo "$label: no autotune file at $tsv"
        fails=$((fails + 1))
    fi
done
unset XDG_CACHE_HOME
rm -rf "$work"
[ "$fails" -eq 0 ]
