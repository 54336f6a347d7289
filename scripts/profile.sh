#!/usr/bin/env bash
# Nsight Compute on one training step of `trainer bench`, for chosen kernels, with the metrics that matter,
# summarised as a short table. Runs on the GPU machine; never changes clocks or power limits
# (--clock-control none). docs/PROFILING.md shows how to read the table.
#   scripts/profile.sh TRAINER_BIN [KERNEL_REGEX] [BATCH] [DTYPE] [LAUNCH_COUNT]
#   e.g. scripts/profile.sh dist-bin/trainer 'regex:gemm|im2col|maxpool' 32 bf16 40
# Output under $OUT (default /tmp): profile.ncu-rep, profile.csv, profile-table.md. PROFILE_SET='key=value' adds
# one --set to the bench (e.g. PROFILE_SET='kernels.bn_stats="fused"'), PROFILE_TAG a suffix to the file names
# (two profiles in one call), SKIP the matching launches to skip first (default 2000).
set -uo pipefail
bin=${1:?trainer binary}
kernels=${2:-regex:.}
batch=${3:-32}
dtype=${4:-bf16}
count=${5:-40}
out=${OUT:-/tmp}
here=$(cd "$(dirname "$0")" && pwd)
ncu=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null || true)
[ -n "$ncu" ] || { echo "profile: ncu (Nsight Compute) not found" >&2; exit 2; }
metrics=(
    sm__throughput.avg.pct_of_peak_sustained_elapsed
    sm__cycles_active.avg
    gpu__time_duration.sum
    dram__bytes.sum
    l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum
    l1tex__t_requests_pipe_lsu_mem_global_op_ld.sum
    sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active
    smsp__average_warps_issue_stalled_memory_throttle_per_issue_active.ratio
    smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio
    smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio
    smsp__average_warps_issue_stalled_math_pipe_throttle_per_issue_active.ratio
)
m=$(IFS=,; echo "${metrics[*]}")
# Skip the warm-up step's launches: profile kernels from the timed step only (one warm-up, one timed step).
"$ncu" --clock-control none --target-processes all --kernel-name "$kernels" --launch-skip "${SKIP:-2000}" \
    --launch-count "$count" --metrics "$m" --export "$out/profile${PROFILE_TAG:-}" --force-overwrite \
    "$bin" bench --config "$here/../configs/resnet152.toml" --set device=cuda:0 ${PROFILE_SET:+--set "$PROFILE_SET"} \
    --dtypes "$dtype" --batch-sizes "$batch" --warmup 1 --steps 1 > "$out/profile-run${PROFILE_TAG:-}.log" 2>&1
rc=$?
tail -5 "$out/profile-run${PROFILE_TAG:-}.log"
"$ncu" --import "$out/profile${PROFILE_TAG:-}.ncu-rep" --csv --page raw > "$out/profile${PROFILE_TAG:-}.csv" 2>/dev/null ||
    { echo "profile: no report"; exit 1; }
python3 - "$out/profile${PROFILE_TAG:-}.csv" <<'PY' | tee "$out/profile-table${PROFILE_TAG:-}.md"
import csv, sys, collections
rows = list(csv.reader(open(sys.argv[1])))
if len(rows) < 3:
    sys.exit("profile: empty report")
head, units, data = rows[0], rows[1], rows[2:]
col = {h: i for i, h in enumerate(head)}
# ncu picks one unit per column (second row): normalise times to ns and sizes to bytes.
scale = {"ns": 1, "nsecond": 1, "us": 1e3, "usecond": 1e3, "ms": 1e6, "msecond": 1e6, "s": 1e9, "second": 1e9,
         "byte": 1, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "Tbyte": 1e12}
def v(r, k):
    try:
        return float(r[col[k]].replace(",", "")) * scale.get(units[col[k]], 1)
    except (KeyError, ValueError):
        return float("nan")
agg = collections.OrderedDict()
for r in data:
    name = r[col["Kernel Name"]][:60]
    a = agg.setdefault(name, collections.defaultdict(float))
    a["n"] += 1
    for k in head:
        if "__" in k:
            a[k] += v(r, k)
print("| kernel | n | time us | SM % peak | tensor pipe % | DRAM GB/s | sectors/req (ld) | stall mem-throttle | stall long-sb |")
print("|---|---|---|---|---|---|---|---|---|")
for name, a in sorted(agg.items(), key=lambda kv: -kv[1]["gpu__time_duration.sum"]):
    n = a["n"]
    t_ns = a["gpu__time_duration.sum"]
    gbs = a["dram__bytes.sum"] / t_ns if t_ns else float("nan")
    spr = a["l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum"] / max(a["l1tex__t_requests_pipe_lsu_mem_global_op_ld.sum"], 1)
    print(f"| {name} | {int(n)} | {t_ns / 1e3:.1f} | {a['sm__throughput.avg.pct_of_peak_sustained_elapsed'] / n:.1f} | "
          f"{a['sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active'] / n:.1f} | {gbs:.0f} | {spr:.1f} | "
          f"{a['smsp__average_warps_issue_stalled_memory_throttle_per_issue_active.ratio'] / n:.2f} | {a['smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio'] / n:.2f} |")
PY
exit $rc
