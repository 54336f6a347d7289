#!/usr/bin/env bash
# Runs ON the GPU machine: our kernels vs candle's (kernels-bench) and cuDNN's (scripts/torch_conv_shapes.py)
# on every distinct ResNet-152 convolution in one invocation, then one joined table with totals, plus the
# matmul vs cuBLAS lines. Writes kernels_bench.json, torch_conv_shapes.json and kernels_table.txt to $OUT.
#   usage: bash scripts/kernels-bench.sh [DIST_DIR] [BATCH] [bf16|f16]     (defaults: dist 128 bf16)
# Needs dist/kernels-bench.gz (scripts/package-gpu.sh) and a Python with torch + torchvision (/opt/torch/.venv).
set -uo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dist="$(cd "${1:-dist}" && pwd)" || { echo "kernels-bench: no dist folder ${1:-dist}" >&2; exit 2; }
batch="${2:-128}"
dtype="${3:-bf16}"
out="${OUT:-$PWD/gpu-out}"
mkdir -p "$out"
py="${PYTHON:-/opt/torch/.venv/bin/python3}"
[ -x "$py" ] || py=python3
site="$("$py" -c 'import nvidia, os; print(list(nvidia.__path__)[0])' 2>/dev/null)"
export LD_LIBRARY_PATH="$site/cu13/lib:$site/cudnn/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
bin="$(mktemp -d /tmp/kbench.XXXXXX)"
gunzip -c "$dist/kernels-bench.gz" > "$bin/kernels-bench" && chmod +x "$bin/kernels-bench" || exit 2

echo "== kernels-bench --batch $batch --dtype $dtype ${KB_ARGS:-}"
# shellcheck disable=SC2086
"$bin/kernels-bench" --batch "$batch" --dtype "$dtype" --json "$out/kernels_bench.json" ${KB_ARGS:-} || exit 1
echo "== cuDNN: scripts/torch_conv_shapes.py $batch $dtype"
OUT="$out" "$py" "$here/scripts/torch_conv_shapes.py" "$batch" "$dtype" > "$out/torch_conv_shapes.log" 2>&1 \
    || { tail -5 "$out/torch_conv_shapes.log"; echo "kernels-bench: cuDNN baseline failed"; }

"$py" - "$out" <<'PY' | tee "$out/kernels_table.txt"
import json, math, os, sys
out = sys.argv[1]
ours = json.load(open(os.path.join(out, "kernels_bench.json")))
try:
    torch = {(r["cin"], r["cout"], r["k"], r["stride"], r["hw"]): r for r in json.load(open(os.path.join(out, "torch_conv_shapes.json")))["rows"]}
except OSError:
    torch = {}
def tf(gflop, ms):
    return "-" if ms is None or ms != ms else f"{gflop / ms:.0f}"
print(f"ResNet-152 convs, batch {ours['batch']}, {ours['dtype']}: TFLOP/s fwd/dgrad/wgrad for ours | candle | cuDNN")
print(f"{'shape':<26}{'x':>3} | {'ours':>15} | {'candle':>15} | {'cuDNN':>15} | ours/cuDNN time")
tot = {"ours": [0, 0, 0], "candle": [0, 0, 0], "cudnn": [0, 0, 0]}
flop = 0.0
for r in ours["convs"]:
    key = (r["cin"], r["cout"], r["k"], r["stride"], r["hw"])
    t = torch.get(key)
    o, c = r["ours"], r["candle"]
    cu = {"fwd_ms": t["fwd_ms"], "dgrad_ms": t["dgrad_ms"], "wgrad_ms": t["wgrad_ms"]} if t else None
    cell = lambda d: "/".join(tf(r["gflop"], d[p + "_ms"]) if d else "-" for p in ("fwd", "dgrad", "wgrad"))
    n = r["count"]
    flop += 3 * r["gflop"] * n
    for name, d in (("ours", o), ("candle", c), ("cudnn", cu)):
        for i, p in enumerate(("fwd", "dgrad", "wgrad")):
            v = d[p + "_ms"] if d else None
            if v is not None and v == v:
                tot[name][i] += v * n
    ratio = "-"
    if cu:
        mine = sum(v for v in (o["fwd_ms"], o["dgrad_ms"] or 0, o["wgrad_ms"]))
        theirs = cu["fwd_ms"] + (cu["dgrad_ms"] if o["dgrad_ms"] is not None else 0) + cu["wgrad_ms"]
        ratio = f"{mine / theirs:.2f}"
    shape = f"{r['cin']}->{r['cout']} k{r['k']} s{r['stride']} hw{r['hw']}"
    print(f"{shape:<26}{n:>3} | {cell(o):>15} | {cell(c):>15} | {cell(cu):>15} | {ratio}")
for name in ("ours", "candle", "cudnn"):
    f, d, w = tot[name]
    ms = f + d + w
    if ms > 0:
        print(f"total {name:<7}: fwd {f:7.1f} ms, dgrad {d:7.1f} ms, wgrad {w:7.1f} ms = {ms:7.1f} ms = {flop / ms:.0f} TFLOP/s mean")
for m in ours["matmul"]:
    g = 2 * m["m"] * m["n"] * m["k"] / 1e9
    print(f"matmul {m['name']:<30} ours {g / m['ours_ms']:.0f} TFLOP/s, cuBLAS {g / m['cublas_ms']:.0f} TFLOP/s: {m['cublas_ms'] / m['ours_ms'] * 100:.0f}% of cuBLAS")
PY
rm -rf "$bin"
