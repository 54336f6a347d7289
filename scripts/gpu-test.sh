#!/usr/bin/env bash
# Runs ON the GPU machine (no Rust there): unpacks the binaries that scripts/package-gpu.sh built, smoke-runs the
# trainer end to end, runs both GPU test binaries with the default multi-threaded harness (kernel choices are
# values, output poisoning is scoped to a test's thread), then the pool, convolution and matmul tests again under
# compute-sanitizer memcheck. Logs go to $OUT (the device tool's output folder; ./gpu-out
# when unset). Exits non-zero if anything fails.
#   usage: bash scripts/gpu-test.sh [DIST_DIR]     (default: dist)
set -uo pipefail
dist="$(cd "${1:-dist}" && pwd)" || { echo "gpu-test: no dist folder ${1:-dist}" >&2; exit 2; }
out="${OUT:-$PWD/gpu-out}"
mkdir -p "$out"

main() {
    local fails=0 bin
    echo "== gpu-test $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname)"
    cat "$dist/BUILD_INFO" 2>/dev/null
    nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv,noheader || true

    bin="$(mktemp -d /tmp/gpu-bin.XXXXXX)"
    for f in trainer gpu-tests gpu-kernel-tests; do
        [ -f "$dist/$f.gz" ] || { echo "gpu-test: missing $dist/$f.gz (run scripts/package-gpu.sh)"; return 2; }
        gunzip -c "$dist/$f.gz" > "$bin/$f" && chmod +x "$bin/$f" || return 2
    done

    # CUDA 13 libraries from the PyTorch environment's wheels; libcuda.so.1 from the driver (GPU.md).
    local site=/opt/torch/.venv/lib/python3.12/site-packages/nvidia
    if [ ! -d "$site/cu13/lib" ]; then
        site="$(python3 -c 'import nvidia, os; print(os.path.dirname(nvidia.__file__) if nvidia.__file__ else list(nvidia.__path__)[0])' 2>/dev/null)"
    fi
    export LD_LIBRARY_PATH="$site/cu13/lib:$site/cudnn/lib:$site/nccl/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
    for f in trainer gpu-tests gpu-kernel-tests; do
        if ldd "$bin/$f" | grep -q "not found"; then
            echo "gpu-test: $f has unresolved libraries:"; ldd "$bin/$f" | grep "not found"; fails=$((fails + 1))
        fi
    done
    ldd "$bin/gpu-tests" | grep -E "cuda|cublas|curand|nvrtc|cudnn" || true

    echo "== trainer: end-to-end ResNet-152 bf16 training on the GPU (loader, 3 steps, validation, checkpoint)"
    local here e2e
    here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
    e2e="$(mktemp -d /tmp/e2e.XXXXXX)"
    if "$bin/trainer" --config "$here/configs/resnet152.toml" --run-dir "$e2e/run" --set data.kind=synthetic \
        --set data.num_samples=96 --set train.batch_size=32 --set train.epochs=1 --set log.every_steps=1 \
        --set log.progress=false --set telemetry.interval_ms=200 > "$out/e2e.log" 2>&1 \
        && [ -f "$e2e/run/checkpoints/best.safetensors" ] && [ -f "$e2e/run/model.safetensors" ]; then
        grep -E "^epoch|^done" "$out/e2e.log"; grep -c '"kind":"telemetry"' "$e2e/run/metrics.jsonl" | sed 's/^/telemetry records: /'
        cp "$e2e/run/metrics.jsonl" "$out/e2e-metrics.jsonl"
        echo "trainer e2e: ok"
    else
        tail -20 "$out/e2e.log"; echo "trainer e2e: FAILED"; fails=$((fails + 1))
    fi
    rm -rf "$e2e"

    echo "== GPU tests: gpu-tests --nocapture (default multi-threaded harness)"
    local t0=$SECONDS
    if RUST_BACKTRACE=1 "$bin/gpu-tests" --nocapture 2>&1 | tee "$out/gpu-tests.log"; then
        echo "gpu-tests: ok ($((SECONDS - t0)) s)"
    else
        echo "gpu-tests: FAILED ($((SECONDS - t0)) s)"; fails=$((fails + 1))
    fi

    echo "== kernel tests: gpu-kernel-tests --nocapture (conv/matmul vs FP32 references, multi-threaded harness)"
    t0=$SECONDS
    if RUST_BACKTRACE=1 "$bin/gpu-kernel-tests" --nocapture > "$out/gpu-kernel-tests.log" 2>&1; then
        grep -E "^test |test result" "$out/gpu-kernel-tests.log"; echo "gpu-kernel-tests: ok ($((SECONDS - t0)) s)"
    else
        grep -E "^test |test result|Error|panicked" "$out/gpu-kernel-tests.log" | head -40
        echo "gpu-kernel-tests: FAILED ($((SECONDS - t0)) s)"; fails=$((fails + 1))
    fi

    local san
    san="$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null || true)"
    if [ "${SANITIZE:-1}" = 1 ] && [ -n "$san" ]; then
        echo "== compute-sanitizer memcheck on the max-pool and average-pool correctness tests"
        t0=$SECONDS
        timeout 150 "$san" --tool memcheck --error-exitcode 99 "$bin/gpu-tests" \
            maxpool_cuda_matches_cpu maxpool_cuda_nan_matches_cpu maxpool_nhwc_cuda_nan_matches_cpu \
            avgpool_nhwc_cuda_matches_cpu > "$out/memcheck.log" 2>&1
        local rc=$?
        timeout 200 "$san" --tool memcheck --error-exitcode 99 "$bin/gpu-kernel-tests" \
            conv_awkward_shapes_match_reference matmul_matches_reference >> "$out/memcheck.log" 2>&1
        local rc2=$?
        [ "$rc" = 0 ] && rc=$rc2
        grep -E "^test |ERROR SUMMARY|test result" "$out/memcheck.log"
        case $rc in
            0) echo "memcheck: ok ($((SECONDS - t0)) s)" ;;
            124) echo "memcheck: timed out after 150 s (not counted as a failure)" ;;
            *) echo "memcheck: FAILED (rc $rc)"; tail -40 "$out/memcheck.log"; fails=$((fails + 1)) ;;
        esac
    else
        echo "== compute-sanitizer: skipped (SANITIZE=${SANITIZE:-1}, found: ${san:-none})"
    fi

    rm -rf "$bin"
    echo "== gpu-test: $fails failure(s)"
    [ "$fails" -eq 0 ]
}

main 2>&1 | tee "$out/gpu-test.log"
exit "${PIPESTATUS[0]}"
