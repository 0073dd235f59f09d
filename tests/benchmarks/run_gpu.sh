#!/usr/bin/env bash
# One device call: the kernel tests on CUDA, then every benchmark; logs and the CSV go to $OUT.
# Usage on the device machine (from the repo root): bash tests/benchmarks/run_gpu.sh
# TESTS (default tests/kernels) and BENCHES (default: every kernel bench) narrow a run; the tables print last.
set -u
OUT=${OUT:-/tmp/bench-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 BENCH_CSV="$OUT/kernels.csv" PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
# squeezeserve is a namespace package mapped over the repo folders (as pyproject's package-dir does).
mkdir -p /tmp/site/squeezeserve && ln -sfn "$PWD/kernels" /tmp/site/squeezeserve/kernels \
  && ln -sfn "$PWD/service" /tmp/site/squeezeserve/service
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw --format=csv | tee "$OUT/gpu.txt"
timeout "${TEST_TIMEOUT:-200}" python3 -m pytest ${TESTS:-tests/kernels} -q -p no:cacheprovider 2>&1 | tail -25 | tee "$OUT/tests.log"
# With vLLM on PYTHONPATH (../shared/device/README.md), quant_matmul is timed beside Marlin and Machete and the
# memory-bound ops beside vLLM's own CUDA ops.
QM_ARGS=(); python3 -c "import vllm" 2>/dev/null && QM_ARGS=(--marlin)
for b in ${BENCHES:-bench_quant_matmul bench_memory_bound bench_cross_entropy}; do
  args=(); [ "$b" = bench_quant_matmul ] && args=("${QM_ARGS[@]}")
  timeout "${BENCH_TIMEOUT:-240}" python3 "tests/benchmarks/$b.py" "${args[@]}" 2>&1 | tee "$OUT/$b.log"
done
# Every peer beside ours, from this run's CSV.
python3 tests/benchmarks/tables.py "$BENCH_CSV" | tee "$OUT/tables.md"
