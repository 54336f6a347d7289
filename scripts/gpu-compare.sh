#!/usr/bin/env bash
# Runs ON the GPU machine: the same measurements with two builds in one call, to show what a change does to speed
# (a refactor must change nothing): kernels-bench (convolutions and matmuls; --no-candle) and ResNet-152 bf16
# training img/s, alternating before / after, then PyTorch eager AMP channels-last for scale. Logs under $OUT.
#   usage: bash scripts/gpu-compare.sh BEFORE_DIST AFTER_DIST [BATCH_SIZES]      (default sizes: 128,256)
# Each dist holds trainer.gz and kernels-bench.gz (scripts/package-gpu.sh). BEFORE_ARGS: extra `trainer bench`
# arguments for the old build (e.g. the --set flags it needed for the custom kernels).
set -uo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
before="$(cd "${1:?before dist}" && pwd)" || exit 2
after="$(cd "${2:?after dist}" && pwd)" || exit 2
sizes="${3:-128,256}"
out="${OUT:-$PWD/gpu-out}"
mkdir -p "$out"
site=/opt/torch/.venv/lib/python3.12/site-packages/nvidia
export LD_LIBRARY_PATH="$site/cu13/lib:$site/cudnn/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
bin="$(mktemp -d /tmp/gpu-compare.XXXXXX)"
for side in before after; do
    dist=$before
    [ "$side" = after ] && dist=$after
    mkdir -p "$bin/$side"
    for f in trainer kernels-bench; do
        gunzip -c "$dist/$f.gz" > "$bin/$side/$f" && chmod +x "$bin/$side/$f" || exit 2
    done
    echo "$side: $(head -1 "$dist/BUILD_INFO")"
done
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,temperature.gpu --format=csv,noheader
fails=0
cfg="$here/configs/resnet152.toml"
# Autotune in memory only, so both builds tune from scratch under the same conditions.
for side in before after after2; do
    b="$bin/${side%2}"
    echo "== kernels-bench ($side): ResNet-152 convolutions + matmul, batch 128 bf16"
    "$b/kernels-bench" --batch 128 --dtype bf16 --no-candle --json "$out/kb-$side.json" > "$out/kb-$side.log" 2>&1 \
        || { tail -5 "$out/kb-$side.log"; fails=$((fails + 1)); }
    grep -E "^total ours|^8192|^fc " "$out/kb-$side.log"
done
for side in before after; do
    extra=""
    [ "$side" = before ] && extra="${BEFORE_ARGS:-}"
    echo "== trainer bench ($side): resnet152 bf16 batch $sizes ${extra}"
    # shellcheck disable=SC2086
    "$bin/$side/trainer" bench --config "$cfg" --dtypes bf16 --batch-sizes "$sizes" --warmup 3 --steps 10 \
        --set kernels.autotune_cache=off $extra > "$out/bench-$side.log" 2>&1 || fails=$((fails + 1))
    grep -E "^bench|^resnet152|error" "$out/bench-$side.log" | head -8
done
echo "== trainer info (after): the kernels the default config resolves to"
"$bin/after/trainer" info --config "$cfg" | head -3
echo "== PyTorch eager AMP channels-last, same sizes"
python3 "$here/scripts/torch_bench.py" resnet152 bf16 "$sizes" --channels-last --warmup 5 --steps 10 \
    > "$out/bench-torch.log" 2>&1 || fails=$((fails + 1))
grep -E "^TORCH_JSON|img/s" "$out/bench-torch.log" | tail -4
rm -rf "$bin"
echo "== gpu-compare: $fails failure(s)"
[ "$fails" -eq 0 ]
