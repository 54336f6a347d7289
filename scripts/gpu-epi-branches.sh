#!/usr/bin/env bash
# Runs ON the GPU machine: builds of the GEMM epilogue kernels against main, in one call:
#   1. `trainer bench` A/B (scripts/ab-bench.sh, ROUNDS rounds, default 2) of main and each variant on the
#      fused-epilogue path (AB_SET='kernels.bn_stats="fused"'), where the epilogue kernels run;
#   2. each variant's `gpu-step-tests epilogue` (the epilogue reductions against the passes);
#   3. the TMA epilogue harness (kernels/dev/gemm/tmabench.cu) of each variant against main's, through
#      scripts/bn-dev-bench.sh (timings, and whether every hash is the same).
#   usage: bash scripts/gpu-epi-branches.sh DIR
# DIR holds main/ and one folder a variant (VARIANTS, default "pf early": the branches epi-prefetch and epi-early
# of docs/BENCHMARKS.md's twenty-second session), each with trainer.xz (and the variants gpu-step-tests.xz), and
# tmabench and tmabench-VARIANT built with nvcc from each checkout. $OUT: summary.txt, tests-VARIANT.log, logs.tgz.
set -uo pipefail
OUT="${OUT:-$PWD/gpu-out}"
mkdir -p "$OUT"
d="${1:?usage: gpu-epi-branches.sh DIR}"
variants="${VARIANTS:-pf early}"
source scripts/gpu-env.sh; gpu_libs
b=$(mktemp -d); mkdir -p "$b/main" "$b/logs" "$b/tma"
unpack_bin "$d/main" "$b/main" trainer || exit 2
specs=("main:$b/main/trainer")
for v in $variants; do
  mkdir -p "$b/$v"; unpack_bin "$d/$v" "$b/$v" trainer || exit 2
  specs+=("$v:$b/$v/trainer")
done
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader | tee $OUT/summary.txt
echo "== A/B, kernels.bn_stats = fused" | tee -a $OUT/summary.txt
AB_SET='kernels.bn_stats="fused"' OUT=$b/logs ROUNDS=${ROUNDS:-2} BENCH_TIMEOUT=80 bash scripts/ab-bench.sh \
  "${specs[@]}" 2>&1 | tee -a $OUT/summary.txt
for v in $variants; do
  unpack_bin $d/$v $b/$v gpu-step-tests || continue
  echo "== gpu-step-tests epilogue ($v)" | tee -a $OUT/summary.txt
  timeout 200 $b/$v/gpu-step-tests epilogue --test-threads=1 --nocapture > $OUT/tests-$v.log 2>&1
  grep -E "^test |test result" $OUT/tests-$v.log | cut -c1-200 | tee -a $OUT/summary.txt
done
for v in $variants; do
  echo "== tmabench $v against main" | tee -a $OUT/summary.txt
  mkdir -p $b/tma/$v
  OUT=$b/tma/$v ROUNDS=1 bash scripts/bn-dev-bench.sh $d/tmabench-$v $d/tmabench > $b/tma/$v/all.txt 2>&1
  grep -E "^(tmabench|l[1-4] |  x|  check|hashes|== )" $b/tma/$v/all.txt | tee -a $OUT/summary.txt
done
tar czf $OUT/logs.tgz -C $b logs tma
