#!/usr/bin/env bash
# Runs ON the GPU machine: the owed checks of one build in one call, figures first, each step only while LIMIT
# (seconds, default 560) leaves room for it:
#   1. gpu-step-tests FIRST_TESTS (default `join`: the joined conv1 grad-inputs and the join_in_conv step, bit for
#      bit; `bn_relu_operand bn_apply_in_conv join_sums` for the normalised conv3 operands);
#   2. an ab-bench.sh A/B of ResNet-152 bf16 batch 256 (ROUNDS rounds while time is left, default 2): the
#      defaults, KERNELS_JOIN_IN_CONV=1, kernels.bn_stats = "fused", and both (VARIANTS picks among
#      main join fused fusedjoin, and nojoin fusednojoin: KERNELS_JOIN_IN_CONV=0, the join being on by default
#      since 7a6e428; nosums: KERNELS_JOIN_SUMS=0, the joined GEMMs without the sums of the BatchNorm before, on by
#      default since d73a6b1; both: KERNELS_BN_APPLY_IN_CONV=both, conv3's input normalised in its forward and
#      grad-weight; with OLD=DIR, old and oldboth: DIR's trainer, default and both; DTYPE=fp16 times fp16); a round
#      starts only if AB_RESERVE seconds (default 0) are left after it;
#   3. with KTRACE=DIR (ktrace.c, ktrace_report.py): kernel timelines of the bf16 step, default and with each
#      KTRACE_VARIANTS (default "join fusedjoin");
#   4. with SWEEP=B: `trainer sweep --max` of ResNet-152 bf16 from batch B (granularity 128, heuristic tiles);
#   5. the other gpu-step tests and the gpu-kernel tests;
#   6. with TMABENCH=FILE: that tmabench binary (the TMA GEMMs with and without their epilogues, joins included;
#      TMABENCH_TABLE=bnin (or main, gsumsw, join, 3x3) runs one table).
#   usage: bash scripts/gpu-owed.sh DIST   (DIST holds trainer, gpu-step-tests, gpu-kernel-tests as .gz or .xz)
# Writes $OUT/owed.txt (the summary), the test and ktrace logs, and logs.tgz (every bench log).
set -uo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dist="${1:?usage: gpu-owed.sh DIST}"
out="${OUT:-$PWD/gpu-out}"
limit="${LIMIT:-560}"
mkdir -p "$out"
sum="$out/owed.txt"
# shellcheck source=scripts/gpu-env.sh
source "$here/scripts/gpu-env.sh"
gpu_libs
bin="$(mktemp -d /tmp/gpu-owed.XXXXXX)"
mkdir -p "$bin/logs"
unpack_bin "$dist" "$bin" trainer gpu-step-tests gpu-kernel-tests || exit 2
if [ -n "${OLD:-}" ]; then
    mkdir -p "$bin/old"
    unpack_bin "$OLD" "$bin/old" trainer || exit 2
fi
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv,noheader | tee -a "$sum"
fails=0
left() { echo $((limit - SECONDS)); }
tests() {  # tests BINARY LOG LIMIT ARGS...
    local b="$1" log="$2" lim="$3" t0=$SECONDS
    shift 3
    (cd "$bin" && RUST_BACKTRACE=1 timeout "$lim" "./$b" "$@" --test-threads=1 --nocapture > "$out/$log" 2>&1) ||
        fails=$((fails + 1))
    grep -E "^test |test result" "$out/$log" | cut -c1-200 | tee -a "$sum"
    echo "($log: $((SECONDS - t0)) s)" | tee -a "$sum"
}
# A variant's words for ab-bench.sh: environment settings, then a binary; a --set goes through a wrapper.
wrap() {  # wrap NAME SET: $bin/NAME runs the trainer with --set SET appended
    printf '#!/bin/sh\nexec %s "$@" --set %q\n' "$bin/trainer" "$2" > "$bin/$1"
    chmod +x "$bin/$1"
}
wrap trainer-fused 'kernels.bn_stats="fused"'
declare -A spec=(
    [main]="$bin/trainer"
    [join]="KERNELS_JOIN_IN_CONV=1 $bin/trainer"
    [fused]="$bin/trainer-fused"
    [fusedjoin]="KERNELS_JOIN_IN_CONV=1 $bin/trainer-fused"
    [nojoin]="KERNELS_JOIN_IN_CONV=0 $bin/trainer"
    [fusednojoin]="KERNELS_JOIN_IN_CONV=0 $bin/trainer-fused"
    [nosums]="KERNELS_JOIN_SUMS=0 $bin/trainer"
    [both]="KERNELS_BN_APPLY_IN_CONV=both $bin/trainer"
    [old]="$bin/old/trainer"
    [oldboth]="KERNELS_BN_APPLY_IN_CONV=both $bin/old/trainer"
)

first="${FIRST_TESTS:-join}"
echo "== 1. the $first tests ($(left) s left)" | tee -a "$sum"
read -r -a first_words <<< "$first"
tests gpu-step-tests step-first.log 200 "${first_words[@]}"

variants=()
for v in ${VARIANTS:-main join fused fusedjoin}; do variants+=("$v:${spec[$v]}"); done
for round in $(seq 1 "${ROUNDS:-2}"); do
    # A round takes about 50 s a variant once tuned (the first, tuning each label's fresh file, about 80).
    need=$(( ${#variants[@]} * (round == 1 ? 80 : 50) ))
    [ "$(left)" -gt $((need + ${AB_RESERVE:-0})) ] || { echo "== A/B round $round skipped ($(left) s left)" | tee -a "$sum"; break; }
    echo "== 2. A/B round $round ($(left) s left)" | tee -a "$sum"
    # One round per ab-bench.sh call; its per-label autotune files live under a fixed folder so later rounds reuse
    # them (the first round tunes).
    XDG_ROOT="$bin/cache" ROUNDS=1 OUT="$bin/logs/r$round" AB_CACHE=shared bash -c '
        for s in "$@"; do l="${s%%:*}"; mkdir -p "$XDG_ROOT/$l"; done
        for s in "$@"; do
            l="${s%%:*}"
            XDG_CACHE_HOME="$XDG_ROOT/$l" bash "'"$here"'/scripts/ab-bench.sh" "$s" | grep -v "mean img/s"
        done' _ "${variants[@]}" | tee -a "$sum"
done
# The means over the rounds, against the first variant.
python3 - "$bin/logs" "${VARIANTS:-main join fused fusedjoin}" <<'EOF' | tee -a "$sum"
import glob, os, sys
root, labels = sys.argv[1], sys.argv[2].split()
base = None
for l in labels:
    rates = []
    for f in sorted(glob.glob(os.path.join(root, "r*", f"ab-{l}-1.log"))):
        rows = [r.split() for r in open(f, errors="replace") if r.startswith("resnet152 ")]
        if rows:
            rates.append(float(rows[-1][3]))
    if not rates:
        print(f"{l:10s} no run finished"); continue
    m = sum(rates) / len(rates)
    base = base or m
    print(f"{l:10s} mean img/s {m:8.1f} over {len(rates)} runs ({', '.join(f'{r:.1f}' for r in rates)}), "
          f"{100 * (m / base - 1):+.2f}% against {labels[0]}")
EOF

if [ -n "${KTRACE:-}" ]; then
    if ktrace_lib "$KTRACE" "$bin/libktrace.so"; then
        for v in main ${KTRACE_VARIANTS-join fusedjoin}; do
            [ "$(left)" -gt 150 ] || { echo "== ktrace $v skipped ($(left) s left)" | tee -a "$sum"; continue; }
            echo "== 3. ktrace $v, bf16 b256 ($(left) s left)" | tee -a "$sum"
            read -r -a words <<< "${spec[$v]}"
            XDG_CACHE_HOME="$bin/cache/$v" CUDA_INJECTION64_PATH="$bin/libktrace.so" KTRACE_OUT="$bin/trace.csv" \
                timeout 150 env "${words[@]}" bench --config "$here/configs/resnet152.toml" --dtypes bf16 \
                --batch-sizes 256 --warmup 3 --steps 5 > "$bin/logs/ktrace-bench-$v.log" 2>&1
            python3 "$KTRACE/ktrace_report.py" "$bin/trace.csv" --marker mt_sgd_f32 --steps 4 --top 30 \
                > "$bin/logs/ktrace-$v.txt" 2>&1
            rm -f "$bin/trace.csv"
            head -32 "$bin/logs/ktrace-$v.txt" | tee -a "$sum"
        done
    else
        echo "ktrace: build failed" | tee -a "$sum"
    fi
fi

if [ -n "${SWEEP:-}" ]; then
    if [ "$(left)" -gt 200 ]; then
        echo "== 4. sweep --max bf16 from $SWEEP ($(left) s left)" | tee -a "$sum"
        XDG_CACHE_HOME="$bin/cache/main" timeout 240 "$bin/trainer" sweep --config "$here/configs/resnet152.toml" \
            --set 'amp.dtype="bf16"' --set 'kernels.autotune=false' --batch-sizes "$SWEEP" --max --granularity 128 \
            --warmup 1 --steps 2 --out "$bin/sweep" \
            > "$bin/logs/sweep.log" 2>&1 || { echo "sweep: FAILED" | tee -a "$sum"; fails=$((fails + 1)); }
        grep -vE "^\s*$" "$bin/logs/sweep.log" | tail -12 | tee -a "$sum"
    else
        echo "== 4. sweep skipped ($(left) s left)" | tee -a "$sum"
    fi
fi

if [ "$(left)" -gt 60 ]; then
    echo "== 5. the other gpu-step tests, the gpu-kernel tests ($(left) s left)" | tee -a "$sum"
    skips=()
    for f in "${first_words[@]}"; do skips+=(--skip "$f"); done
    tests gpu-step-tests step-all.log "$(( $(left) > 200 ? 180 : $(left) - 20 ))" "${skips[@]}"
    [ "$(left)" -gt 40 ] && tests gpu-kernel-tests kernel-tests.log "$(( $(left) - 20 ))"
fi
if [ -n "${TMABENCH:-}" ] && [ "$(left)" -gt 30 ]; then
    echo "== 6. tmabench ($(left) s left)" | tee -a "$sum"
    timeout "$(( $(left) - 10 ))" "$TMABENCH" 256 ${TMABENCH_TABLE:-} > "$out/tmabench.txt" 2>&1
    grep -iE "join|bnin|conv3|total|step|  x" "$out/tmabench.txt" | head -40 | tee -a "$sum"
fi
(cd "$bin" && tar czf "$out/logs.tgz" logs)
rm -rf "$bin"
echo "== gpu-owed: $fails failure(s), $SECONDS s" | tee -a "$sum"
[ "$fails" -eq 0 ]
