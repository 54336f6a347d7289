#!/usr/bin/env bash
# Runs ON the GPU machine: is a branch's kernel change faster and still right? One call, figures first, for one
# or more branches against main:
#   1. `trainer bench` A/B, main against every branch (scripts/ab-bench.sh: ResNet-152 bf16 batch 256,
#      alternating, ROUNDS rounds, default 3; AB_SET='key=value' puts every run on a non-default path);
#   2. each branch's gpu-step tests (all, or those matching STEP_TESTS="name ..."), with their printed errors;
#   3. each branch's gpu-tests matching GPU_TESTS (default "cooperative batchnorm"; empty skips them);
#   4. each dev harness that main's folder and a branch's both hold, branch against main (scripts/bn-dev-bench.sh:
#      timings, and whether every hash is the same): bnbench (kernels/dev/batchnorm/bnbench.cu, the BatchNorm
#      kernels) and tmabench (kernels/dev/gemm/tmabench.cu, the TMA GEMMs and their epilogues);
#   5. with MAIN_STEP_TESTS=1 and gpu-step-tests in MAIN: main's gpu-step tests too.
#   usage: bash scripts/gpu-ab-branch.sh MAIN_DIR BRANCH_DIR [BRANCH_DIR ...]
# Each DIR holds trainer[.xz|.gz] and BUILD_INFO (scripts/package-gpu.sh, recompressed with xz to fit the carry
# limit), a BRANCH_DIR also gpu-step-tests and gpu-tests, and any may hold bnbench / tmabench[.xz|.gz], each built
# with nvcc on its checkout (the harnesses' headers say how). A branch is named by its folder's name. Writes
# $OUT/summary.txt (the lines below), the test logs (step-tests-NAME.log, tests-NAME.log) and logs.tgz (the A/B
# and harness logs): with one or two branches, within the device tool's 8 files.
set -uo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
usage="usage: gpu-ab-branch.sh MAIN_DIR BRANCH_DIR [BRANCH_DIR ...]"
main="${1:?$usage}"
shift
[ $# -ge 1 ] || { echo "$usage" >&2; exit 2; }
declare -A dir=([main]="$main")
names=()
for d in "$@"; do
    name="$(basename "$d")"
    [ -z "${dir[$name]:-}" ] || { echo "gpu-ab-branch: two folders named $name" >&2; exit 2; }
    dir[$name]="$d"
    names+=("$name")
done
out="${OUT:-$PWD/gpu-out}"
mkdir -p "$out"
summary="$out/summary.txt"
t0=$SECONDS
log() { echo "[$((SECONDS - t0))s] $*" | tee -a "$summary"; }
# shellcheck source=scripts/gpu-env.sh
source "$here/scripts/gpu-env.sh"
gpu_libs
bin="$(mktemp -d /tmp/gpu-ab-branch.XXXXXX)"
mkdir -p "$bin/logs"
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit,driver_version --format=csv,noheader 2>&1 | tee -a "$summary"
specs=()
for side in main "${names[@]}"; do
    mkdir -p "$bin/$side"
    log "$side: $(head -1 "${dir[$side]}/BUILD_INFO" 2>/dev/null || echo "no BUILD_INFO in ${dir[$side]}")"
    unpack_bin "${dir[$side]}" "$bin/$side" trainer || { log "gpu-ab-branch: no trainer in ${dir[$side]}"; exit 2; }
    specs+=("$side:$bin/$side/trainer")
done
fails=0

log "== A/B: main / ${names[*]} (ResNet-152 bf16 batch ${BATCH:-256}, ${ROUNDS:-3} rounds${AB_SET:+, --set $AB_SET})"
OUT="$bin/logs" ROUNDS="${ROUNDS:-3}" BENCH_TIMEOUT="${BENCH_TIMEOUT:-70}" bash "$here/scripts/ab-bench.sh" \
    "${specs[@]}" 2>&1 | tee -a "$summary"

# run_tests SIDE BINARY LOG FILTERS...: one test binary of SIDE, its results and printed errors into the summary.
run_tests() {
    local side="$1" name="$2" logf="$3" rc
    shift 3
    if ! unpack_bin "${dir[$side]}" "$bin/$side" "$name" 2> /dev/null; then
        log "$side: no $name, skipped"
        return 0
    fi
    log "== $name ($side) ${*:-(all)}"
    # Word splitting of the filters is wanted: each is one libtest filter.
    timeout "${TEST_TIMEOUT:-300}" "$bin/$side/$name" "$@" --test-threads=1 --nocapture > "$out/$logf" 2>&1
    rc=$?
    grep -E "^test |test result|px (f32|bf16|fp16)|fp16 steps|^Error" "$out/$logf" | cut -c1-200 | tee -a "$summary"
    [ "$rc" -eq 0 ] || { log "$name ($side): exit $rc"; fails=$((fails + 1)); }
}
for side in "${names[@]}"; do
    # shellcheck disable=SC2086
    run_tests "$side" gpu-step-tests "step-tests-$side.log" ${STEP_TESTS:-}
    if [ -n "${GPU_TESTS-cooperative batchnorm}" ]; then
        # shellcheck disable=SC2086
        run_tests "$side" gpu-tests "tests-$side.log" ${GPU_TESTS-cooperative batchnorm}
    fi
done

# The dev harnesses, each branch's build against main's: the hash verdict, then each side's figures (bnbench: its
# probe and per-step lines; tmabench: its shape rows, host checks and per-step lines).
for h in bnbench tmabench; do
    unpack_bin "$main" "$bin/main" "$h" 2> /dev/null || { log "main: no $h, that harness skipped"; continue; }
    for side in "${names[@]}"; do
        unpack_bin "${dir[$side]}" "$bin/$side" "$h" 2> /dev/null || { log "$side: no $h, skipped"; continue; }
        log "== $h: new = $side, old = main"
        hl="$bin/logs/$h-$side"
        mkdir -p "$hl"
        OUT="$hl" ROUNDS=1 timeout 120 bash "$here/scripts/bn-dev-bench.sh" "$bin/$side/$h" "$bin/main/$h" \
            > "$hl/all.txt" 2>&1
        tail -1 "$hl/all.txt" | tee -a "$summary"
        for v in old new; do
            echo "-- $v ($([ "$v" = old ] && echo main || echo "$side"))"
            if [ "$h" = bnbench ]; then
                sed -n '/phase 1.s reads alone/,$p' "$hl/bnbench-$v-1.txt"
            else
                grep -E "^(l[1-4] |  x|  check|tmabench: [0-9]+ host)" "$hl/bnbench-$v-1.txt"
            fi
        done | tee -a "$summary"
    done
done

if [ -n "${MAIN_STEP_TESTS:-}" ]; then
    # shellcheck disable=SC2086
    run_tests main gpu-step-tests step-tests-main.log ${STEP_TESTS:-}
fi
(cd "$bin" && tar czf "$out/logs.tgz" logs)
rm -rf "$bin"
log "== gpu-ab-branch: $fails failure(s)"
[ "$fails" -eq 0 ]
