#!/usr/bin/env bash
# Runs ON the GPU machine: is a branch's kernel change faster and still right? One call, figures first:
#   1. `trainer bench` A/B, main against the branch (scripts/ab-bench.sh: ResNet-152 bf16 batch 256, alternating,
#      ROUNDS rounds, default 3);
#   2. the branch's gpu-step tests (all, or those matching STEP_TESTS="name ..."), with their printed errors;
#   3. the branch's gpu-tests matching GPU_TESTS (default "cooperative batchnorm"; empty skips them);
#   4. with bnbench in both folders: the BatchNorm harness (scripts/bn-dev-bench.sh, branch against main);
#   5. with MAIN_STEP_TESTS=1 and gpu-step-tests in MAIN: main's gpu-step tests too.
#   usage: bash scripts/gpu-ab-branch.sh MAIN_DIR BRANCH_DIR
# Each DIR holds trainer[.xz|.gz] and BUILD_INFO (scripts/package-gpu.sh, recompressed with xz to fit the carry
# limit), BRANCH_DIR also gpu-step-tests and gpu-tests, and either may hold bnbench[.xz|.gz] (nvcc -O3 -std=c++17
# -arch=sm_90 -I kernels -L <the wheel's lib> -o bnbench kernels/dev/batchnorm/bnbench.cu, built on each
# checkout). Writes $OUT/summary.txt (the lines below), the test logs, and logs.tgz (the A/B and harness logs):
# at most 6 files, within the device tool's 8.
set -uo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
main="${1:?usage: gpu-ab-branch.sh MAIN_DIR BRANCH_DIR}"
branch="${2:?usage: gpu-ab-branch.sh MAIN_DIR BRANCH_DIR}"
out="${OUT:-$PWD/gpu-out}"
mkdir -p "$out"
summary="$out/summary.txt"
t0=$SECONDS
log() { echo "[$((SECONDS - t0))s] $*" | tee -a "$summary"; }
# shellcheck source=scripts/gpu-env.sh
source "$here/scripts/gpu-env.sh"
gpu_libs
bin="$(mktemp -d /tmp/gpu-ab-branch.XXXXXX)"
mkdir -p "$bin/main" "$bin/branch" "$bin/logs"
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit,driver_version --format=csv,noheader 2>&1 | tee -a "$summary"
for side in main branch; do
    dir=$main
    [ "$side" = branch ] && dir=$branch
    log "$side: $(head -1 "$dir/BUILD_INFO" 2>/dev/null || echo "no BUILD_INFO in $dir")"
    unpack_bin "$dir" "$bin/$side" trainer || { log "gpu-ab-branch: no trainer in $dir"; exit 2; }
done
fails=0

log "== A/B: main / branch (ResNet-152 bf16 batch ${BATCH:-256}, ${ROUNDS:-3} rounds)"
OUT="$bin/logs" ROUNDS="${ROUNDS:-3}" BENCH_TIMEOUT="${BENCH_TIMEOUT:-70}" bash "$here/scripts/ab-bench.sh" \
    "main:$bin/main/trainer" "branch:$bin/branch/trainer" 2>&1 | tee -a "$summary"

# run_tests SIDE BINARY LOG FILTERS...: one test binary of SIDE, its results and printed errors into the summary.
run_tests() {
    local side="$1" name="$2" logf="$3" rc
    shift 3
    if ! unpack_bin "$([ "$side" = main ] && echo "$main" || echo "$branch")" "$bin/$side" "$name" 2> /dev/null; then
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
# shellcheck disable=SC2086
run_tests branch gpu-step-tests step-tests-branch.log ${STEP_TESTS:-}
if [ -n "${GPU_TESTS-cooperative batchnorm}" ]; then
    # shellcheck disable=SC2086
    run_tests branch gpu-tests tests-branch.log ${GPU_TESTS-cooperative batchnorm}
fi

if unpack_bin "$main" "$bin/main" bnbench 2> /dev/null && unpack_bin "$branch" "$bin/branch" bnbench 2> /dev/null; then
    log "== BatchNorm harness: new = branch, old = main"
    mkdir -p "$bin/logs/bnb"
    OUT="$bin/logs/bnb" ROUNDS=1 timeout 60 bash "$here/scripts/bn-dev-bench.sh" "$bin/branch/bnbench" \
        "$bin/main/bnbench" > "$bin/logs/bnb/all.txt" 2>&1
    tail -1 "$bin/logs/bnb/all.txt" | tee -a "$summary"
    for v in old new; do
        echo "-- $v ($([ "$v" = old ] && echo main || echo branch))"
        sed -n '/phase 1.s reads alone/,$p' "$bin/logs/bnb/bnbench-$v-1.txt"
    done | tee -a "$summary"
else
    log "no bnbench in both folders: the harness skipped"
fi

if [ -n "${MAIN_STEP_TESTS:-}" ]; then
    # shellcheck disable=SC2086
    run_tests main gpu-step-tests step-tests-main.log ${STEP_TESTS:-}
fi
(cd "$bin" && tar czf "$out/logs.tgz" logs)
rm -rf "$bin"
log "== gpu-ab-branch: $fails failure(s)"
[ "$fails" -eq 0 ]
