#!/usr/bin/env bash
# Runs ON the GPU machine: the explicit ("fused") training step against autograd. One call:
#   1. with GPU_TESTS_FILTER="NAME ..." and dist/gpu-tests.gz: the tests/tests/gpu.rs tests whose names contain a NAME
#      (e.g. batchnorm: the BatchNorm kernels against the CPU reference);
#   2. `trainer bench` ResNet-152 at BATCH (default 256) with kernels.step = fused in DTYPES (default bf16,fp16;
#      empty skips it; with TORCH=1 instead scripts/bench-vs-torch.sh: the trainer with no --set and PyTorch eager
#      AMP channels-last in the same call; its "graph:" line says whether the steps replayed a CUDA graph), then
#      the fused step without its graph (kernels.graph = "off", the first dtype; EAGER_COMPARE= skips it) and with
#      the fused BatchNorm reductions (kernels.bn_stats = "fused", then "auto": per conv shape where timed faster;
#      EPI_COMPARE= skips both; with EPI_HALVES=1 also "forward" and "backward" alone) and with one cooperative
#      launch a BatchNorm pass (kernels.bn_cooperative = true; COOP_COMPARE= skips it, COOP_COMPARE="fused-coop
#      fused-coopauto fused-coopfused fused-fwdchunks fused-im2colgather fused-nostempool fused-chunks3" adds it
#      with kernels.bn_stats = "auto" and "fused", with phase 1 taking the row chunks first to last, with the
#      stem's im2col on the gather kernel, with the stem's BatchNorm + ReLU + max-pool forward in three launches
#      (fused-nostempool: KERNELS_STEM_POOL_FUSED=0) or its backward in one (fused-stempoolbwd:
#      KERNELS_STEM_POOL_BWD_FUSED=1), and with the BatchNorm reductions in 132 x 3 row chunks
#      (KERNELS_BN_CHUNKS_PER_SM=3; any fused-chunksN, N = 1 .. 8); fused-joinmask: with the block outputs'
#      ReLU masks read by the joined backward instead of the outputs (KERNELS_JOIN_MASK=1); fused-compact: with the
#      stride-2 downsamples' grad-inputs on their own grid (KERNELS_COMPACT_SHORTCUT=1); fused-maskcompact: both;
#      both are the defaults since 2026-12-06: fused-nomask and fused-nocompact turn each off, =0; fused-bnin:
#      each bottleneck's conv3 input normalised inside its 1x1 GEMMs, KERNELS_BN_APPLY_IN_CONV=both;
#      fused-bninbwd: in the grad-weight only, =backward),
#      with RECOMPUTE_BENCH=1 with kernels.recompute = "relu" and "relu+conv" (the peak memory against
#      "none"), then
#      autograd in AUTOGRAD_DTYPES (default bf16; empty skips it) -- figures first, as device time is short;
#   3. gpu-step-tests: tests/tests/gpu_step.rs (residual kernels vs CPU, fused vs autograd loss and every gradient
#      in bf16/fp16 on ResNet-18/50/152, three fp16 StepRunner steps with a skipped one, ten steps replayed from a
#      CUDA graph against the same steps run eagerly, the fused BatchNorm reductions against the passes;
#      STEP_TESTS=0 skips them, for a second call);
#   4. with SWEEP=B: `trainer sweep --max` of ResNet-152 bf16 on the fused step from batch B (heuristic tiles, 1 + 2
#      steps per probe, granularity 128): the largest batch that fits; SWEEP_RECOMPUTE=1 repeats it with
#      kernels.recompute = "relu" and "relu+conv"; SWEEP_SET='key=value' adds one --set to each sweep;
#   5. with KTRACE=DIR (a folder holding ktrace.c and ktrace_report.py, ../shared/tools/ktrace copied into the
#      carried tree): a kernel timeline of the fused bf16 step, summarised here (the CSV stays on the machine),
#      when at least 100 s of TIME_BUDGET_S (default 600) are left; KTRACE_SET='key=value' adds one --set (e.g.
#      KTRACE_SET='kernels.bn_stats="auto"'; KTRACE_DTYPE=fp16 traces the fp16 step, KTRACE_DTYPE="bf16 fp16"
#      both, then pairs their launches with scripts/ktrace-steps.py diff);
#   6. with dist/dp-tests.gz: the trainer's data_parallel test synced_step_on_cuda (synchronised BatchNorm in bf16);
#      with NCCL_CHECK=1 (a trainer built with NCCL=1): `trainer launch --nproc-per-node 1 -- dist-check --nccl`,
#      then quickstart.toml on cuda in bf16 trained twice plainly and once as rank 0 of 1 through NCCL: the step
#      losses must agree within the run-to-run noise;
#   7. with KBENCH=SECTION and dist/kernels-bench.gz (first, before the trainer bench): `kernels-bench --only
#      SECTION` (e.g. bn: the fused BatchNorm reductions against the kernels they replace);
#   8. with DATA_E2E=1: ResNet-152 bf16 training from 3,072 generated JPEGs (scripts/data-bench-gpu.sh,
#      ONLY_TRAIN=1, THREADS loader threads, default 16): the step rate against the loader rate.
# Logs under $OUT (./gpu-out when unset): gpu-step.log, and every other log in logs.tgz at the end.   usage: bash scripts/gpu-step.sh [DIST_DIR]
set -uo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dist="$(cd "${1:-dist}" && pwd)" || { echo "gpu-step: no dist folder" >&2; exit 2; }
out="${OUT:-$PWD/gpu-out}"
mkdir -p "$out"
batch="${BATCH:-256}"
dtypes="${DTYPES-bf16,fp16}"

# run_tests BIN LOG LIMIT PATTERN [ARGS...]: runs the test binary $bin/BIN with ARGS and --nocapture into
# $out/LOG within LIMIT seconds, counts a failure in `fails` (main's), prints the lines of LOG matching PATTERN.
run_tests() {
    local b="$1" log="$2" limit="$3" pat="$4" t0=$SECONDS
    shift 4
    if RUST_BACKTRACE=1 timeout "$limit" "$bin/$b" "$@" --nocapture > "$out/$log" 2>&1; then
        echo "$b: ok ($((SECONDS - t0)) s)"
    else
        echo "$b: FAILED ($((SECONDS - t0)) s)"; fails=$((fails + 1))
    fi
    grep -E "$pat" "$out/$log" | head -60
}

# shellcheck source=scripts/gpu-env.sh
source "$(dirname "${BASH_SOURCE[0]}")/gpu-env.sh"
# unpack NAME: $dist/NAME.gz or $dist/NAME.xz (prepare-gpurun.sh with GPURUN_XZ=1) into $bin/NAME, executable.
unpack() { unpack_bin "$dist" "$bin" "$1" 2> /dev/null; }

# has NAME: whether $dist holds NAME.gz or NAME.xz.
has() { [ -f "$dist/$1.gz" ] || [ -f "$dist/$1.xz" ]; }

main() {
    local fails=0 bin site
    echo "== gpu-step $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    cat "$dist/BUILD_INFO" 2>/dev/null
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
    bin="$(mktemp -d /tmp/gpu-step.XXXXXX)"
    for f in trainer gpu-step-tests; do
        unpack "$f" || { echo "gpu-step: missing $dist/$f.gz (or .xz)"; return 2; }
    done
    gpu_libs

    if [ -n "${GPU_TESTS_FILTER:-}" ] && has gpu-tests; then
        echo "== gpu-tests $GPU_TESTS_FILTER"
        unpack gpu-tests
        # shellcheck disable=SC2086  # several space-separated filters: libtest runs the tests matching any
        run_tests gpu-tests gpu-tests.log 120 "^test |test result|rel err|panicked" $GPU_TESTS_FILTER
    fi

    if [ -n "${KBENCH:-}" ] && has kernels-bench; then
        echo "== kernels-bench --only $KBENCH (ResNet-152 shapes, batch $batch, bf16)"
        unpack kernels-bench
        timeout "${KBENCH_TIMEOUT:-180}" "$bin/kernels-bench" --only "$KBENCH" --batch "$batch" \
            > "$out/kernels-bench.log" 2>&1 || { echo "kernels-bench: FAILED"; fails=$((fails + 1)); }
        grep -vE "^\s*$" "$out/kernels-bench.log" | tail -40
    fi

    if [ -n "${TORCH:-}" ] && [ -n "$dtypes" ]; then
        echo "== bench-vs-torch resnet152 b$batch $dtypes (trainer with no --set: the fused step by default)"
        OUT="$out" timeout "${TORCH_TIMEOUT:-300}" bash "$here/scripts/bench-vs-torch.sh" "$bin/trainer" resnet152 \
            "$dtypes" "$batch" > /dev/null 2>&1 || { echo "bench-vs-torch: FAILED"; fails=$((fails + 1)); }
        cat "$out/bench-table.md" 2>/dev/null
        dtypes=""
    fi

    local step dts graph stats
    # EPI_HALVES=1: also each half of the fused reductions alone (kernels.bn_stats = "forward" / "backward").
    local coop rc
    for step in fused ${EAGER_COMPARE-fused-eager} ${COOP_COMPARE-fused-coop} ${EPI_COMPARE-fused-epistats fused-epiauto} ${EPI_HALVES:+fused-epifwd fused-epibwd} ${RECOMPUTE_BENCH:+fused-rcrelu fused-rcconv} autograd; do
        dts="$dtypes"
        graph=auto
        stats=pass
        coop=false
        rc=none
        [ "$step" = autograd ] && dts="${AUTOGRAD_DTYPES-bf16}"
        # fused-eager: the fused step without its CUDA graph (kernels.graph = "off"); fused-epistats: with the
        # fused BatchNorm reductions (kernels.bn_stats = "fused"); fused-epiauto: the same per conv shape where
        # timed faster ("auto"); all in the first dtype only.
        [ "$step" = fused-eager ] && { graph=off; dts="${dtypes%%,*}"; }
        # fused-coop: one cooperative launch a BatchNorm pass (kernels.bn_cooperative = true).
        [ "$step" = fused-coop ] && { coop=true; dts="${dtypes%%,*}"; }
        # fused-coopauto: both, the cooperative passes where the epilogue does not take the reduction.
        [ "$step" = fused-coopauto ] && { coop=true; stats=auto; dts="${dtypes%%,*}"; }
        # fused-coopfused: cooperative launches taking every epilogue's moments (kernels.bn_stats = "fused").
        [ "$step" = fused-coopfused ] && { coop=true; stats=fused; dts="${dtypes%%,*}"; }
        # fused-fwdchunks: the default cooperative launches with their phase 1 taking the row chunks first to last
        # (KERNELS_BN_CHUNKS_FORWARD=1; the default takes them last to first, where the L2 holds the producer's
        # output).
        local fwdchunks="" im2colgather=""
        [ "$step" = fused-fwdchunks ] && { coop=true; fwdchunks=1; dts="${dtypes%%,*}"; }
        # fused-im2colgather: the default cooperative launches with the stem's im2col on the gather kernel
        # (KERNELS_IM2COL_GATHER=1; the default stages the input rows in shared memory).
        [ "$step" = fused-im2colgather ] && { coop=true; im2colgather=1; dts="${dtypes%%,*}"; }
        # fused-nostempool: the stem's BatchNorm + ReLU and max-pool forward in three launches
        # (KERNELS_STEM_POOL_FUSED=0; the default is one); fused-stempoolbwd: the pool's backward inside the stem
        # BatchNorm's backward too (KERNELS_STEM_POOL_BWD_FUSED=1; the default is two launches).
        local stempool="" stempoolbwd="" chunks="" joinmask="" compact=""
        [ "$step" = fused-nostempool ] && { coop=true; stempool=0; dts="${dtypes%%,*}"; }
        [ "$step" = fused-stempoolbwd ] && { coop=true; stempoolbwd=1; dts="${dtypes%%,*}"; }
        # fused-chunksN (N = 1 .. 8): the BatchNorm reductions split into 132 x N row chunks
        # (KERNELS_BN_CHUNKS_PER_SM=N; the default is 3).
        case "$step" in fused-chunks[1-8]) coop=true; chunks=${step#fused-chunks}; dts="${dtypes%%,*}" ;; esac
        # fused-joinmask: the joined backward gated by the block outputs' ReLU masks (KERNELS_JOIN_MASK=1).
        [ "$step" = fused-joinmask ] && { coop=true; joinmask=1; dts="${dtypes%%,*}"; }
        # fused-compact: the stride-2 downsamples' grad-inputs on their own grid (KERNELS_COMPACT_SHORTCUT=1).
        [ "$step" = fused-compact ] && { coop=true; compact=1; dts="${dtypes%%,*}"; }
        [ "$step" = fused-maskcompact ] && { coop=true; joinmask=1; compact=1; dts="${dtypes%%,*}"; }
        [ "$step" = fused-nomask ] && { coop=true; joinmask=0; dts="${dtypes%%,*}"; }
        [ "$step" = fused-nocompact ] && { coop=true; compact=0; dts="${dtypes%%,*}"; }
        # fused-bnin / fused-bninbwd: each bottleneck's conv3 input normalised inside the 1x1 GEMMs, forward and
        # grad-weight / the grad-weight only (KERNELS_BN_APPLY_IN_CONV=both / backward).
        local bnin=""
        [ "$step" = fused-bnin ] && { coop=true; bnin=both; dts="${dtypes%%,*}"; }
        [ "$step" = fused-bninbwd ] && { coop=true; bnin=backward; dts="${dtypes%%,*}"; }
        [ "$step" = fused-epistats ] && { stats=fused; dts="${dtypes%%,*}"; }
        # fused-rcrelu / fused-rcconv: kernels.recompute = "relu" / "relu+conv" (the peak memory against "none").
        [ "$step" = fused-rcrelu ] && { rc=relu; dts="${dtypes%%,*}"; }
        [ "$step" = fused-rcconv ] && { rc=relu+conv; dts="${dtypes%%,*}"; }
        [ "$step" = fused-epiauto ] && { stats=auto; dts="${dtypes%%,*}"; }
        [ "$step" = fused-epifwd ] && { stats=forward; dts="${dtypes%%,*}"; }
        [ "$step" = fused-epibwd ] && { stats=backward; dts="${dtypes%%,*}"; }
        [ -n "$dts" ] || continue
        echo "== bench resnet152 b$batch $dts, kernels.step = ${step%%-*}, kernels.graph = $graph, kernels.bn_stats = $stats, kernels.bn_cooperative = $coop, kernels.recompute = $rc"
        KERNELS_BN_CHUNKS_FORWARD="$fwdchunks" KERNELS_IM2COL_GATHER="$im2colgather" KERNELS_STEM_POOL_FUSED="$stempool" KERNELS_STEM_POOL_BWD_FUSED="$stempoolbwd" KERNELS_BN_CHUNKS_PER_SM="$chunks" KERNELS_JOIN_MASK="$joinmask" KERNELS_COMPACT_SHORTCUT="$compact" KERNELS_BN_APPLY_IN_CONV="${bnin:-${KERNELS_BN_APPLY_IN_CONV:-}}" timeout "${BENCH_TIMEOUT:-150}" "$bin/trainer" bench --config "$here/configs/resnet152.toml" \
            --set "kernels.step=\"${step%%-*}\"" --set "kernels.graph=\"$graph\"" --set "kernels.bn_stats=\"$stats\"" \
            --set "kernels.bn_cooperative=$coop" --set "kernels.recompute=\"$rc\"" \
            --dtypes "$dts" --batch-sizes "$batch" --warmup 3 --steps 10 > "$out/bench-$step.log" 2>&1 \
            || { echo "bench $step: FAILED"; fails=$((fails + 1)); }
        grep -vE "^\s*$" "$out/bench-$step.log" | tail -8
    done

    if [ "${STEP_TESTS:-1}" != 0 ]; then
        echo "== gpu-step-tests --nocapture"
        # One test at a time: a CUDA graph capture (the runner tests) must not share the GPU with other threads'
        # work (another thread's synchronising call invalidates the capture, and the capture's refusals fail the
        # other thread's operations).
        run_tests gpu-step-tests gpu-step-tests.log "${TEST_TIMEOUT:-400}" "^test |test result|rel err|bit for bit|graph vs eager|panicked|Error" --test-threads=1
    fi

    if [ -n "${SWEEP:-}" ]; then
        # SWEEP_RECOMPUTE=1: the sweep again with kernels.recompute = "relu" and "relu+conv", into the same log.
        local rc
        : > "$out/sweep.log"
        for rc in none ${SWEEP_RECOMPUTE:+relu relu+conv}; do
            echo "== sweep --max resnet152 bf16 fused, kernels.recompute = $rc (heuristic tiles, from $SWEEP)" \
                | tee -a "$out/sweep.log"
            timeout "${SWEEP_TIMEOUT:-240}" "$bin/trainer" sweep --config "$here/configs/resnet152.toml" \
                --set 'kernels.step="fused"' --set 'amp.dtype="bf16"' --set 'kernels.autotune=false' \
                --set "kernels.recompute=\"$rc\"" ${SWEEP_SET:+--set "$SWEEP_SET"} --batch-sizes "$SWEEP" --max --granularity 128 --warmup 1 \
                --steps 2 --out "$bin/sweep-$rc" >> "$out/sweep.log" 2>&1 || { echo "sweep: FAILED"; fails=$((fails + 1)); }
            grep -vE "^\s*$" "$out/sweep.log" | tail -14
        done
    fi

    if [ -n "${KTRACE:-}" ] && [ -f "$KTRACE/ktrace.c" ] && [ $((SECONDS + 100)) -lt "${TIME_BUDGET_S:-600}" ]; then
        local sp="$GPU_SITE/cu13" inc kd kds=()
        inc="$(dirname "$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)")/../include"
        if gcc -O2 -shared -fPIC "$KTRACE/ktrace.c" -o "$bin/libktrace.so" -I"$sp/include" -I"$inc" \
            -L"$sp/lib" -l:libcupti.so.13 -lpthread; then
            for kd in ${KTRACE_DTYPE:-bf16}; do
                echo "== ktrace: fused $kd b$batch"
                CUDA_INJECTION64_PATH="$bin/libktrace.so" KTRACE_OUT="$bin/trace.csv" timeout 120 "$bin/trainer" bench \
                    --config "$here/configs/resnet152.toml" --set 'kernels.step="fused"' ${KTRACE_SET:+--set "$KTRACE_SET"} \
                    --dtypes "$kd" --batch-sizes "$batch" --warmup 3 --steps 5 > "$out/ktrace-bench-$kd.log" 2>&1
                python3 "$KTRACE/ktrace_report.py" "$bin/trace.csv" --marker 'mt_sgd_f32' --steps 4 --top 40 \
                    > "$out/ktrace-fused-$kd.txt" 2>&1 || echo "ktrace report failed"
                python3 "$here/scripts/ktrace-steps.py" step "$bin/trace.csv" --marker 'mt_sgd_f32' \
                    > "$out/ktrace-step-$kd.tsv" 2>&1 && kds+=("$kd") || echo "ktrace-steps failed"
                rm -f "$bin/trace.csv"
                head -60 "$out/ktrace-fused-$kd.txt"
            done
            if [ "${#kds[@]}" -eq 2 ]; then
                echo "== ktrace: ${kds[1]} against ${kds[0]}, launch by launch (scripts/ktrace-steps.py diff)"
                python3 "$here/scripts/ktrace-steps.py" diff "$out/ktrace-step-${kds[0]}.tsv" \
                    "$out/ktrace-step-${kds[1]}.tsv" --top 30 > "$out/ktrace-diff.txt" 2>&1
                head -75 "$out/ktrace-diff.txt"
            fi
        else
            echo "ktrace: build failed"
        fi
    fi
    if has dp-tests; then
        echo "== dp-tests synced_step_on_cuda (synchronised BatchNorm, 4 ranks as threads on this GPU, bf16)"
        unpack dp-tests
        run_tests dp-tests dp-tests.log 120 "^test |test result|median|worst five|panicked" synced_step_on_cuda
    fi
    if [ -n "${NCCL_CHECK:-}" ]; then
        echo "== dist-check --nccl at world size 1 (trainer launch --nproc-per-node 1; a build with NCCL=1)"
        timeout 120 "$bin/trainer" launch --nproc-per-node 1 --master-port 29517 -- dist-check --nccl \
            > "$out/dist-check.log" 2>&1 || { echo "dist-check --nccl: FAILED"; fails=$((fails + 1)); }
        tail -5 "$out/dist-check.log"
        echo "== data-parallel training at world size 1 through NCCL against a plain run (quickstart on cuda, bf16)"
        local dp=(--config "$here/configs/quickstart.toml" --set 'device="cuda"' --set 'amp.dtype="bf16"'
            --set train.epochs=1 --set log.every_steps=1)
        rm -rf "$bin/plain" "$bin/plain2" "$bin/dp1"
        timeout 120 "$bin/trainer" "${dp[@]}" --run-dir "$bin/plain" > "$out/dp1.log" 2>&1 \
            && timeout 120 "$bin/trainer" "${dp[@]}" --run-dir "$bin/plain2" >> "$out/dp1.log" 2>&1 \
            && timeout 180 "$bin/trainer" launch --nproc-per-node 1 --master-port 29518 -- "${dp[@]}" \
                --run-dir "$bin/dp1" >> "$out/dp1.log" 2>&1 \
            && python3 - "$bin/plain" "$bin/plain2" "$bin/dp1" <<'PYEOF' 2>&1 | tee -a "$out/dp1.log" \
            || { echo "data-parallel world size 1: FAILED"; fails=$((fails + 1)); }
import json, sys
def losses(d):
    return [r["loss"] for r in map(json.loads, open(d + "/metrics.jsonl")) if r.get("kind") == "step"]
a, b, c = (losses(d) for d in sys.argv[1:4])
assert len(a) == len(b) == len(c) > 0, (len(a), len(b), len(c))
noise = max(abs(x - y) for x, y in zip(a, b))
diff = max(abs(x - y) for x, y in zip(a, c))
print(f"{len(a)} steps: plain vs plain max |dloss| {noise:.3g}; plain vs NCCL world 1 {diff:.3g}; last {a[-1]:.4f} / {c[-1]:.4f}")
assert diff <= max(1e-3, 4 * noise), "the NCCL path at world size 1 trains differently"
PYEOF
        tail -3 "$out/dp1.log"
    fi
    if [ -n "${DATA_E2E:-}" ]; then
        echo "== ResNet-152 bf16 training from a generated JPEG folder (scripts/data-bench-gpu.sh, ONLY_TRAIN=1)"
        ONLY_TRAIN=1 timeout "${DATA_TIMEOUT:-300}" bash "$here/scripts/data-bench-gpu.sh" "$bin/trainer" "$out" \
            > /dev/null 2>&1 || { echo "data-bench-gpu: FAILED"; fails=$((fails + 1)); }
        grep -E "step rate|waits for data|epoch [0-9]+:|FAILED|^# [0-9]+ training|GPU memory while|^error" "$out/data-bench.log" 2>/dev/null
        grep -E "^# cpu" "$out/data-bench.log" 2>/dev/null | tail -8
    fi
    rm -rf "$bin"
    # Few files come back from the GPU machine: every log but this one goes into one archive, logs.tgz.
    local list
    list="$(cd "$out" && ls -A | grep -vxE 'gpu-step\.log|logs\.tgz')"
    if [ -n "$list" ]; then
        (cd "$out" && printf '%s\n' "$list" | tar czf logs.tgz -T - --remove-files) || echo "gpu-step: logs.tgz failed"
    fi
    echo "== gpu-step: $fails failure(s)"
    [ "$fails" -eq 0 ]
}

main 2>&1 | tee "$out/gpu-step.log"
exit "${PIPESTATUS[0]}"
