#!/usr/bin/env bash
# Runs `trainer bench` and the PyTorch reference (scripts/torch_bench.py) in one invocation on the same GPU and
# prints one table with the ratios. Runs on the GPU machine.
#   scripts/bench-vs-torch.sh TRAINER_BIN [ARCH] [DTYPES] [BATCH_SIZES] [extra trainer args...]
#   e.g. scripts/bench-vs-torch.sh dist/trainer resnet152 fp32,bf16,fp16 64,128,256
# Logs go to $OUT (default /tmp): bench-rust.log, bench-torch.log, bench-table.md.
set -uo pipefail
bin=${1:?trainer binary}
arch=${2:-resnet152}
dtypes=${3:-fp32,bf16,fp16}
sizes=${4:-64,128,256}
shift $(( $# < 4 ? $# : 4 ))
out=${OUT:-/tmp}
here=$(cd "$(dirname "$0")" && pwd)
"$bin" bench --config "$here/../configs/resnet152.toml" --set model.arch="$arch" --set device=cuda:0 \
    --dtypes "$dtypes" --batch-sizes "$sizes" --warmup "${BENCH_WARMUP:-3}" --steps "${BENCH_STEPS:-10}" "$@" 2>&1 | tee "$out/bench-rust.log"
rust_rc=${PIPESTATUS[0]}
python3 "$here/torch_bench.py" "$arch" "$dtypes" "$sizes" --channels-last --warmup 5 --steps 10 2>&1 | tee "$out/bench-torch.log"
python3 - "$out/bench-rust.log" "$out/bench-torch.log" <<'PY' | tee "$out/bench-table.md"
import json, sys
def load(path, tag):
    rows = {}
    for line in open(path, errors="replace"):
        if line.startswith(tag):
            r = json.loads(line[len(tag):])
            rows[(r["dtype"], r["batch_size"])] = r
    return rows
ours, torch = load(sys.argv[1], "BENCH_JSON "), load(sys.argv[2], "TORCH_JSON ")
def f(v, p=1):
    return "-" if v is None else f"{v:,.{p}f}"
# Memory both ways on both sides: "device" is what the process holds on the GPU (ours: NVML's peak over the run;
# PyTorch's: cudaMemGetInfo after the timed steps, its caching allocator keeping its reserve), "alloc" the
# allocators' peaks (ours: the default pool's and the CUDA graphs' used-memory high watermarks over the timed
# steps, their sum; PyTorch's: max_memory_allocated / max_memory_reserved).
print("| dtype | batch | ours img/s | ours GiB device / alloc | PyTorch img/s (channels-last) | PyTorch GiB device / allocated / reserved | ours / PyTorch |")
print("|---|---|---|---|---|---|---|")
for k in sorted(set(ours) | set(torch)):
    o, t = ours.get(k, {}), torch.get(k, {})
    oi, ti = o.get("img_per_s"), t.get("img_per_s")
    ratio = f"{oi / ti:.3f}" if oi and ti else "-"
    oo = " (OOM)" if o.get("oom") else ""
    to = " (OOM)" if t.get("oom") else ""
    om = f"{f(o.get('peak_gib'), 2)} / {f(o.get('alloc_gib'), 2)}"
    tm = f"{f(t.get('device_gib'), 2)} / {f(t.get('peak_gib'), 2)} / {f(t.get('reserved_gib'), 2)}"
    print(f"| {k[0]} | {k[1]} | {f(oi)}{oo} | {om} | {f(ti)}{to} | {tm} | {ratio} |")
PY
exit $rust_rc
