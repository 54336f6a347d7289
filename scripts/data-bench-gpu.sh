#!/usr/bin/env bash
# Input pipeline on the GPU machine (issue #15): 3,072 ImageNet-sized JPEGs generated into /tmp, then
#   1. trainer data-bench on the JPEG folder, 16 threads, CPU device and CUDA device (bf16, channels-last input),
#   2. trainer prepare (packed shards) and data-bench on them (CPU and CUDA),
#   3. a short ResNet-152 bf16 training from the JPEG folder (batch 256, 3 epochs = 36 steps) reporting the step
#      rate and the loader rate (metrics.jsonl).
# Everything it runs and prints goes to $OUT/data-bench.log.
#
#   bash scripts/data-bench-gpu.sh TRAINER_BIN OUT_DIR      (LD_LIBRARY_PATH set for the CUDA libraries)
#
# Env: THREADS (16), COUNT (3072), MAX_SIDE (packed, 320), STEPS_EPOCHS (3), SKIP_TRAIN=1 to leave out step 3,
# ONLY_TRAIN=1 to leave out steps 1 and 2, TRAIN_TIMEOUT (300 s) and TRAIN_SET ('key=value': one --set) for step 3.
set -euo pipefail

BIN=${1:?usage: data-bench-gpu.sh TRAINER_BIN OUT_DIR}
OUT=${2:-${OUT:?usage: data-bench-gpu.sh TRAINER_BIN OUT_DIR}}
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
THREADS=${THREADS:-16}
COUNT=${COUNT:-3072}
MAX_SIDE=${MAX_SIDE:-320}
EPOCHS=${STEPS_EPOCHS:-3}
DATA=/tmp/databench-jpegs-$COUNT
PACK=/tmp/databench-packed-$COUNT-$MAX_SIDE
CFG=/tmp/databench.toml
RUN=/tmp/databench-run
mkdir -p "$OUT"
LOG="$OUT/data-bench.log"
: >"$LOG"

say() { echo "$*" | tee -a "$LOG"; }
# Runs a command, printing it first; its output goes to the terminal and the log; a failure is reported and
# counted, and the script goes on with the next step.
FAILED=0
run() {
    say "+ $*"
    local rc=0
    "$@" 2>&1 | tee -a "$LOG" || rc=$?
    if [ "$rc" -ne 0 ]; then
        say "FAILED (exit $rc): $*"
        FAILED=$((FAILED + 1))
    fi
    return 0
}

PY=python3
for p in /opt/torch/.venv/bin/python3 /opt/torch/.venv/bin/python; do
    if [ -x "$p" ]; then PY=$p; break; fi
done

say "# data-bench-gpu.sh $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname), $(nproc) cores, binary $BIN"
run "$BIN" --version
command -v nvidia-smi >/dev/null && run nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv

if [ ! -f "$DATA/.done" ]; then
    rm -rf "$DATA"
    run "$PY" "$REPO/scripts/gen-jpegs.py" --out "$DATA" --count "$COUNT" --val-count 256 --classes 8 --jobs "$THREADS"
    touch "$DATA/.done"
else
    say "# reusing $DATA"
fi
say "# $(find "$DATA/train" -name '*.JPEG' | wc -l) training JPEGs, $(du -sh "$DATA/train" | cut -f1)"

cat >"$CFG" <<EOF
seed = 0
device = "cpu"
[model]
arch = "resnet152"
num_classes = 8
[data]
kind = "imagefolder"
train_dir = "$DATA/train"
val_dir = "$DATA/val"
image_size = 224
val_resize = 256
workers = $THREADS
prefetch = 4
[train]
batch_size = 256
[amp]
dtype = "bf16"
[kernels]
conv = "custom"
matmul = "custom"
[log]
progress = false
every_steps = 1
[checkpoint]
every_epochs = 0
keep_last = 1
EOF
say "# config $CFG:"
cat "$CFG" >>"$LOG"

if [ "${ONLY_TRAIN:-0}" != 1 ]; then
    say "## 1. JPEG folder, $THREADS threads"
    run "$BIN" data-bench --config "$CFG" --workers "$THREADS" --batches 24
    run "$BIN" data-bench --config "$CFG" --set device=cuda --workers "$THREADS" --batches 24

    say "## 2. packed shards (max side $MAX_SIDE)"
    run "$BIN" prepare --config "$CFG" --out "$PACK" --max-side "$MAX_SIDE"
    run du -sh "$PACK/train"
    PACKED=(--set data.kind=packed --set "data.dir=\"$PACK\"")
    run "$BIN" data-bench --config "$CFG" "${PACKED[@]}" --workers "$THREADS" --batches 24
    run "$BIN" data-bench --config "$CFG" "${PACKED[@]}" --set device=cuda --workers "$THREADS" --batches 24
fi

if [ "${SKIP_TRAIN:-0}" != 1 ]; then
    say "## 3. ResNet-152 bf16 training from the JPEG folder, batch 256, $EPOCHS epochs"
    rm -rf "$RUN"
    # The GPU's memory every 250 ms while it trains ($OUT/data-bench-mem.csv: time, MiB used), and the backtrace of
    # a failure (RUST_BACKTRACE): where memory grows across steps, validation and the epoch boundaries.
    MEMLOG="$OUT/data-bench-mem.csv"
    MEMPID=""
    if command -v nvidia-smi >/dev/null; then
        nvidia-smi --query-gpu=timestamp,memory.used --format=csv,noheader,nounits -lms 250 >"$MEMLOG" 2>/dev/null &
        MEMPID=$!
    fi
    # Which threads of the trainer take the CPU, per second (the loader's workers against the rest, from the
    # threads' utime + stime in /proc), and the machine's CPU use, into the log: does the loader get the cores it
    # had in data-bench while the GPU trains?
    (
        tick=$(getconf CLK_TCK)
        prev_all=""
        declare -A prev
        while sleep 1; do
            pid=$(pgrep -n -f -- "--run-dir $RUN") || { [ -n "$prev_all" ] && break; continue; }
            read -ra cpu < <(head -1 /proc/stat)
            all=$((cpu[1] + cpu[2] + cpu[3] + cpu[4] + cpu[5] + cpu[6] + cpu[7]))
            idle=$((cpu[4] + cpu[5]))
            # Per thread (tid), so that threads that end between two samples (each epoch's loader pool) drop out
            # instead of subtracting their time from their name's total; a new thread counts from its start.
            declare -A now=() per=()
            for st in /proc/"$pid"/task/*/stat; do
                # comm is field 2 in parentheses; utime and stime are fields 14 and 15.
                line=$(cat "$st" 2>/dev/null) || continue
                tid=${st%/stat}; tid=${tid##*/}
                name=${line#*(}; name=${name%%)*}; name=${name%%[-_0-9]*}
                rest=${line##*) }; read -ra f <<<"$rest"
                now[$tid]=$(( f[11] + f[12] ))
                per[$name]=$(( ${per[$name]:-0} + now[$tid] - ${prev[$tid]:-0} ))
            done
            if [ -n "$prev_all" ]; then
                d=$((all - prev_all)); busy=$((d - (idle - prev_idle)))
                out="# cpu/s $(date +%T): machine $(( d > 0 ? 100 * busy / d : 0 ))% busy; threads (% of a core):"
                for k in "${!per[@]}"; do out+=" $k $(( per[$k] * 100 / tick ))"; done
                echo "$out"
            fi
            prev_all=$all; prev_idle=$idle
            prev=(); for k in "${!now[@]}"; do prev[$k]=${now[$k]}; done
            unset now per
        done
    ) >>"$LOG" 2>/dev/null &
    CPUPID=$!
    run env RUST_BACKTRACE=1 timeout "${TRAIN_TIMEOUT:-300}" "$BIN" --config "$CFG" --set device=cuda \
        --set "train.epochs=$EPOCHS" --run-dir "$RUN" ${TRAIN_SET:+--set "$TRAIN_SET"}
    kill "$CPUPID" 2>/dev/null || true
    if [ -n "$MEMPID" ]; then
        kill "$MEMPID" 2>/dev/null || true
        wait "$MEMPID" 2>/dev/null || true
        say "# GPU memory while training (MiB used): $(awk -F', ' '{ if ($2 > m) m = $2; n++ } END { print "max " m " over " n " samples" }' "$MEMLOG")"
    fi
    if [ -f "$RUN/metrics.jsonl" ]; then
        cp "$RUN/metrics.jsonl" "$OUT/train-metrics.jsonl"
        say "# step rate (img/s, steps 4 onwards: the first steps autotune and warm up) and loader rate:"
        "$PY" - "$RUN/metrics.jsonl" <<'PYEOF' 2>&1 | tee -a "$LOG"
import json, sys
steps, epochs = [], []
for line in open(sys.argv[1]):
    r = json.loads(line)
    if r.get("kind") == "step":
        steps.append(r)
    elif r.get("kind") == "epoch":
        epochs.append(r)
late = [s["img_per_s"] for s in steps if s["step"] > 3]
if late:
    late.sort()
    print(f"step rate: median {late[len(late) // 2]:.0f} img/s over {len(late)} steps (min {late[0]:.0f}, max {late[-1]:.0f})")
waits = sorted(s.get("data_wait_ms", 0.0) for s in steps if s["step"] > 3)
if waits:
    over = sum(1 for w in waits if w > 5.0)
    print(f"waits for data: median {waits[len(waits) // 2]:.1f} ms, max {waits[-1]:.1f} ms; {over} of {len(waits)} steps waited over 5 ms")
for e in epochs:
    print(f"epoch {e['epoch']}: train {e['img_per_s']:.0f} img/s, loader {e['loader_img_per_s']:.0f} img/s, waited {e.get('data_wait_s', 0.0):.2f} s for data")
PYEOF
    fi
fi

say "# summary (DATA_BENCH_JSON lines):"
grep -h '^DATA_BENCH_JSON' "$LOG" | tee "$OUT/data-bench.jsonl" || true
say "# done: $FAILED failed step(s); log $LOG"
exit "$FAILED"
