#!/usr/bin/env bash
# Runs ON the GPU machine: an A/B of `trainer bench` variants on one warm machine, alternating, ROUNDS rounds
# (default 2), so that the machine's drift (clocks, temperature) falls on every variant alike. A variant is
# LABEL:[VAR=VALUE ...] TRAINER, one argument (environment settings, then the binary), e.g. two builds and a switch:
#   bash scripts/ab-bench.sh old:/tmp/b/old-trainer new:/tmp/b/trainer 'nostem:KERNELS_STEM_POOL_FUSED=0 /tmp/b/trainer'
# Each run: ResNet-152 (configs/resnet152.toml, no --set: the defaults) in DTYPE (default bf16) at BATCH (default
# 256), WARMUP (3) + STEPS (10) steps. Prints one line per run (label, round, img/s, peak GiB, alloc GiB) and a
# summary per label (mean img/s, against the first label); logs in $OUT (default .): ab-LABEL-ROUND.log.
# AB_SET='key=value' adds one --set to every run (e.g. AB_SET='kernels.bn_stats="forward"': two builds on a
# non-default path). AB_CACHE: "label" (default) gives each label its own autotune file, fresh at the start (its
# first run tunes, later rounds read it), so that a build is timed on the tiles it picks itself and not on picks
# another build's kernels (or another path's runs) made; "shared" leaves every run on the machine's file.
set -uo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="${OUT:-$PWD}"
mkdir -p "$out"
[ $# -ge 1 ] || { echo "usage: ab-bench.sh LABEL:[VAR=VALUE ...] TRAINER ..." >&2; exit 2; }
declare -A sum=() n=()
specs=("$@") labels=() words=()
for spec in "${specs[@]}"; do labels+=("${spec%%:*}"); done
caches=""
if [ "${AB_CACHE:-label}" = label ]; then
    caches="$(mktemp -d /tmp/ab-bench-cache.XXXXXX)"
    trap 'rm -rf "$caches"' EXIT
elif [ "${AB_CACHE}" != shared ]; then
    echo "ab-bench: AB_CACHE=$AB_CACHE is not one of label, shared" >&2
    exit 2
fi
for round in $(seq 1 "${ROUNDS:-2}"); do
    for spec in "${specs[@]}"; do
        label="${spec%%:*}"
        # The variant's words: environment settings, then the binary.
        read -r -a words <<< "${spec#*:}"
        log="$out/ab-$label-$round.log"
        cache=()
        [ -z "$caches" ] || cache=("XDG_CACHE_HOME=$caches/$label")
        timeout "${BENCH_TIMEOUT:-150}" env "${cache[@]}" "${words[@]}" bench --config "$here/configs/resnet152.toml" \
            ${AB_SET:+--set "$AB_SET"} --dtypes "${DTYPE:-bf16}" --batch-sizes "${BATCH:-256}" \
            --warmup "${WARMUP:-3}" --steps "${STEPS:-10}" \
            > "$log" 2>&1 || echo "ab-bench: $label round $round failed (see $log)"
        # The table row: arch, dtype, batch, img/s, step ms, peak GiB, alloc GiB.
        row="$(grep -E "^resnet152 " "$log" | tail -1)"
        rate="$(awk '{print $4}' <<< "$row")"
        printf '%-12s round %d  img/s %-9s peak GiB %-7s alloc GiB %s\n' "$label" "$round" "${rate:--}" \
            "$(awk '{print $6}' <<< "$row")" "$(awk '{print $7}' <<< "$row")"
        if [[ "$rate" =~ ^[0-9.]+$ ]]; then
            sum[$label]="$(awk -v a="${sum[$label]:-0}" -v b="$rate" 'BEGIN {print a + b}')"
            n[$label]=$(( ${n[$label]:-0} + 1 ))
        fi
    done
done
first=""
for label in "${labels[@]}"; do
    [ -n "${n[$label]:-}" ] || { echo "$label: no run finished"; continue; }
    mean="$(awk -v s="${sum[$label]}" -v k="${n[$label]}" 'BEGIN {printf "%.1f", s / k}')"
    [ -n "$first" ] || first="$mean"
    awk -v l="$label" -v m="$mean" -v f="$first" -v k="${n[$label]}" \
        'BEGIN {printf "%-12s mean img/s %s over %d runs, %+.2f%% against the first\n", l, m, k, 100 * (m / f - 1)}'
done
