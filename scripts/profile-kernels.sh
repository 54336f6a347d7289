#!/usr/bin/env bash
# Nsight Compute on our conv/matmul kernels for one ResNet-152 conv shape (kernels-bench --filter), one tile
# variant forced, with the metrics that say where a tensor-core kernel loses time (tensor pipe activity, warp
# stall reasons, shared-memory bank conflicts, occupancy, DRAM traffic). Runs on the GPU machine; never changes
# clocks (--clock-control none). Output under $OUT: kprofile.ncu-rep, kprofile.csv, kprofile.txt (metric per line).
#   usage: bash scripts/profile-kernels.sh KERNELS_BENCH_BIN "SHAPE" [TILE] [KERNEL_REGEX]
#   e.g.   bash scripts/profile-kernels.sh /tmp/kernels-bench " 256-> 256 k3 s1 hw 14" t128 'regex:conv_(fwd|dgrad|wgrad)_'
set -uo pipefail
bin=${1:?kernels-bench binary}
shape=${2:?shape filter, as kernels-bench prints it}
tile=${3:-t128}
kernels=${4:-regex:conv_(fwd|dgrad|wgrad)_}
out=${OUT:-/tmp}
ncu=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null || true)
[ -n "$ncu" ] || { echo "profile-kernels: ncu (Nsight Compute) not found" >&2; exit 2; }
metrics=(
    gpu__time_duration.sum
    sm__throughput.avg.pct_of_peak_sustained_elapsed
    sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active
    sm__warps_active.avg.pct_of_peak_sustained_active
    dram__bytes.sum
    dram__throughput.avg.pct_of_peak_sustained_elapsed
    l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum
    l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum
    l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum
    smsp__inst_executed.sum
    smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio
    smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio
    smsp__average_warps_issue_stalled_short_scoreboard_per_issue_active.ratio
    smsp__average_warps_issue_stalled_math_pipe_throttle_per_issue_active.ratio
    smsp__average_warps_issue_stalled_mio_throttle_per_issue_active.ratio
    smsp__average_warps_issue_stalled_wait_per_issue_active.ratio
    smsp__average_warps_issue_stalled_not_selected_per_issue_active.ratio
    smsp__average_warps_issue_stalled_selected_per_issue_active.ratio
    smsp__average_warps_issue_stalled_dispatch_stall_per_issue_active.ratio
    smsp__average_warps_issue_stalled_lg_throttle_per_issue_active.ratio
)
m=$(IFS=,; echo "${metrics[*]}")
# Skip the forward pass's three warm-up launches; the next 7 are its timed launch and every launch of grad-input and
# grad-weight (strided grad-input: one per phase class).
"$ncu" --clock-control none --kernel-name "$kernels" --launch-skip "${SKIP:-3}" --launch-count "${COUNT:-7}" \
    --metrics "$m" --export "$out/kprofile" --force-overwrite \
    "$bin" --filter "$shape" --tile "$tile" --iters 1 --no-candle --no-matmul > "$out/kprofile-run.log" 2>&1
tail -3 "$out/kprofile-run.log"
"$ncu" --import "$out/kprofile.ncu-rep" --csv --page raw > "$out/kprofile.csv" 2>/dev/null || { echo "profile-kernels: no report"; exit 1; }
python3 - "$out/kprofile.csv" <<'PY' | tee "$out/kprofile.txt"
import csv, sys
rows = list(csv.reader(open(sys.argv[1])))
head, units, data = rows[0], rows[1], rows[2:]
for r in data:
    print("kernel:", r[head.index("Kernel Name")])
    for i, h in enumerate(head):
        if "__" in h:
            print(f"  {h:<85} {r[i]:>16} {units[i]}")
PY
