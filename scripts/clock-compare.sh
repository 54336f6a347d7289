#!/usr/bin/env bash
# Runs ON the GPU machine: `trainer bench` of ResNet-152 (batch BATCH, default 256) in each dtype of DTYPES
# (default "bf16 fp16"), one after the other, with nvidia-smi sampling the SM clock, power draw, temperature and
# the software power-cap flag every 100 ms. Prints each run's img/s and those figures over its timed steps (the
# second half of the run's samples), so a rate difference between the dtypes can be told apart from a clock one:
# the same kernels on data that toggles more bits draw more power, and at the power cap the clock drops.
#   usage: bash scripts/clock-compare.sh TRAINER [OUT_DIR]   (logs: OUT_DIR/clock-*.{log,csv}, default $OUT or .)
set -uo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
trainer="${1:?usage: clock-compare.sh TRAINER [OUT_DIR]}"
out="${2:-${OUT:-$PWD}}"
mkdir -p "$out"
batch="${BATCH:-256}"
fields="clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.sw_power_cap"
nvidia-smi --query-gpu="$fields" --format=csv,noheader,nounits > /dev/null 2>&1 \
    || fields="clocks.sm,power.draw,temperature.gpu"
for dt in ${DTYPES:-bf16 fp16}; do
    nvidia-smi --query-gpu="$fields" --format=csv,noheader,nounits -lms 100 > "$out/clock-$dt.csv" 2>&1 &
    smi=$!
    timeout "${BENCH_TIMEOUT:-150}" "$trainer" bench --config "$here/configs/resnet152.toml" --dtypes "$dt" \
        --batch-sizes "$batch" --warmup 5 --steps "${STEPS:-60}" > "$out/clock-bench-$dt.log" 2>&1 \
        || echo "clock-compare: the $dt bench failed (see clock-bench-$dt.log)"
    kill "$smi" 2> /dev/null
    wait "$smi" 2> /dev/null
    # The bench's table row: arch, dtype, batch, img/s, step ms, peak GiB, alloc GiB.
    rate="$(grep -E '^resnet' "$out/clock-bench-$dt.log" | tail -1 | awk '{print $4 " img/s, " $5 " ms a step"}')"
    python3 - "$out/clock-$dt.csv" "$dt" "${rate:-no rate}" <<'PYEOF'
import sys
rows = []
for line in open(sys.argv[1]):
    parts = [p.strip() for p in line.split(",")]
    try:
        rows.append((float(parts[0]), float(parts[1]), float(parts[2]), parts[3] if len(parts) > 3 else ""))
    except (ValueError, IndexError):
        pass
timed = rows[len(rows) // 2:]
if not timed:
    sys.exit(f"{sys.argv[2]}: no nvidia-smi samples")
clk = [r[0] for r in timed]
pw = [r[1] for r in timed]
capped = sum(1 for r in timed if r[3] == "Active")
print(f"{sys.argv[2]}: {sys.argv[3]}; over {len(timed)} samples of the timed half: SM clock mean {sum(clk) / len(clk):.0f} "
      f"MHz (min {min(clk):.0f}, max {max(clk):.0f}), power mean {sum(pw) / len(pw):.0f} W (max {max(pw):.0f}), "
      f"temperature max {max(r[2] for r in timed):.0f} C, software power cap active in {capped} samples")
PYEOF
done
