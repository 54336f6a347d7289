#!/usr/bin/env bash
# Nsight Compute on the fused step's BatchNorm kernels inside a real ResNet-152 training step (`trainer bench`,
# eager, so that each launch is its own kernel): per launch its time, the DRAM bytes it moved against what its
# tensors hold, its DRAM throughput and L2 hit rate, and the warp stall reasons, to tell a kernel that moves
# more bytes than it must from one that moves them slowly (issue #14: BatchNorm is ~36 ms of a 76 ms step, all
# of it memory-bound). Runs on the GPU machine; never changes clocks (--clock-control none).
#   usage: bash scripts/profile-bn.sh TRAINER_BIN [KERNEL_REGEX]      (LD_LIBRARY_PATH set for the CUDA libraries)
# Env: BATCH (256), SKIP (launches of the regex to skip, default 320: the warm-up step's 306 and 14 of the next
# forward; 460 reaches its backward), COUNT (40), OUT (/tmp), TAG (output name suffix). Heuristic conv tiles
# (kernels.autotune = false: the BatchNorm kernels do not depend on them, and the run starts at once).
# Output under $OUT: bnprofile.ncu-rep, bnprofile.csv, bnprofile.txt (one line per launch, then per kernel).
set -uo pipefail
bin=${1:?trainer binary}
kernels=${2:-regex:bn_nhwc_train}
out=${OUT:-/tmp}
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
ncu=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null || true)
[ -n "$ncu" ] || { echo "profile-bn: ncu (Nsight Compute) not found" >&2; exit 2; }
metrics=(
    gpu__time_duration.sum
    dram__bytes_read.sum
    dram__bytes_write.sum
    dram__throughput.avg.pct_of_peak_sustained_elapsed
    lts__t_sector_hit_rate.pct
    sm__warps_active.avg.pct_of_peak_sustained_active
    launch__grid_size
    smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio
    smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio
    smsp__average_warps_issue_stalled_lg_throttle_per_issue_active.ratio
    smsp__average_warps_issue_stalled_membar_per_issue_active.ratio
)
m=$(IFS=,; echo "${metrics[*]}")
"$ncu" --clock-control none --kernel-name "$kernels" --launch-skip "${SKIP:-320}" --launch-count "${COUNT:-40}" \
    --metrics "$m" --export "$out/bnprofile${TAG:-}" --force-overwrite \
    "$bin" bench --config "$here/configs/resnet152.toml" --set 'kernels.graph="off"' --set 'kernels.autotune=false' --dtypes bf16 \
    --batch-sizes "${BATCH:-256}" --warmup 1 --steps 1 > "$out/bnprofile${TAG:-}-run.log" 2>&1
tail -3 "$out/bnprofile${TAG:-}-run.log"
"$ncu" --import "$out/bnprofile${TAG:-}.ncu-rep" --csv --page raw > "$out/bnprofile${TAG:-}.csv" 2>/dev/null \
    || { echo "profile-bn: no report"; exit 1; }
python3 - "$out/bnprofile${TAG:-}.csv" <<'PY' | tee "$out/bnprofile${TAG:-}.txt"
import csv, sys
from collections import defaultdict
rows = list(csv.reader(open(sys.argv[1])))
head, units, data = rows[0], rows[1], rows[2:]
col = {h: i for i, h in enumerate(head)}
def num(r, h):
    try:
        return float(r[col[h]].replace(",", ""))
    except (KeyError, ValueError):
        return float("nan")
def scale(h):
    u = units[col[h]] if h in col else ""
    return {"byte": 1, "Kbyte": 1e3, "KB": 1e3, "Mbyte": 1e6, "MB": 1e6, "Gbyte": 1e9, "GB": 1e9, "nsecond": 1e-9,
            "ns": 1e-9, "usecond": 1e-6, "us": 1e-6, "msecond": 1e-3, "ms": 1e-3}.get(u, 1)
print(f"{'kernel':<40} {'grid':>5} {'us':>8} {'read MB':>9} {'write MB':>9} {'GB/s':>7} {'dram%':>6} {'L2 hit%':>7} "
      f"{'barrier':>7} {'long sb':>7} {'lg thr':>7}")
per = defaultdict(lambda: [0, 0.0, 0.0])
for r in data:
    name = r[col["Kernel Name"]].split("(")[0]
    t = num(r, "gpu__time_duration.sum") * scale("gpu__time_duration.sum")
    rd = num(r, "dram__bytes_read.sum") * scale("dram__bytes_read.sum")
    wr = num(r, "dram__bytes_write.sum") * scale("dram__bytes_write.sum")
    print(f"{name[:40]:<40} {num(r, 'launch__grid_size'):>5.0f} {t * 1e6:>8.1f} {rd / 1e6:>9.1f} {wr / 1e6:>9.1f} "
          f"{(rd + wr) / t / 1e9 if t > 0 else 0:>7.0f} {num(r, 'dram__throughput.avg.pct_of_peak_sustained_elapsed'):>6.1f} "
          f"{num(r, 'lts__t_sector_hit_rate.pct'):>7.1f} "
          f"{num(r, 'smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio'):>7.2f} "
          f"{num(r, 'smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio'):>7.2f} "
          f"{num(r, 'smsp__average_warps_issue_stalled_lg_throttle_per_issue_active.ratio'):>7.2f}")
    p = per[name]
    p[0] += 1; p[1] += t; p[2] += rd + wr
print()
print(f"{'kernel':<40} {'launches':>8} {'ms':>8} {'GB moved':>9} {'GB/s':>7}")
for name, (n, t, b) in sorted(per.items(), key=lambda kv: -kv[1][1]):
    print(f"{name[:40]:<40} {n:>8} {t * 1e3:>8.3f} {b / 1e9:>9.3f} {b / t / 1e9 if t > 0 else 0:>7.0f}")
PY
