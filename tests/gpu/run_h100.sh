#!/usr/bin/env bash
# vLLM with squeezeserve inside, on the lent H100 (issue 6). Runs on the device machine from the repo root,
# after vLLM 0.26.0 was staged into /tmp/vllm-site and the bundled GGUF into /tmp/b/smollm2.gguf
# (../shared/device/README.md). Logs, JSON and CSV go to $OUT.
#
#   bash tests/gpu/run_h100.sh ab      # convert + compress the bundled model; run 3: our ops on vs off
#   bash tests/gpu/run_h100.sh ckpt    # run 1: baseline/int8/int4 by vLLM behind our gateway, c = 1, 16, 64
#   bash tests/gpu/run_h100.sh synth   # run 2: 8B-class synthetic Llama: bf16 / W4A16 vLLM / W4A16 ours
#
# Data for GPTQ calibration: .vllm-bundle/data/calibration.txt (carried; wikitext-2 calibration split).
set -uo pipefail
STAGE=${1:?usage: run_h100.sh ab|ckpt|synth}
OUT=${OUT:-/tmp/vllm-out}
# $OUT brings back at most 8 files: logs go to $LOGS and come back as one tarball.
LOGS=/tmp/vllm-logs/$STAGE
mkdir -p "$OUT" "$LOGS"
REPO=$PWD
CSV="$OUT/vllm_serving.csv"
# Servers start in their own sessions (setsid) and would outlive this script: stop them on any exit.
STARTED=()
trap 'for p in "${STARTED[@]}"; do kill -KILL -- "-$p" 2>/dev/null; done; tar -C /tmp/vllm-logs -czf "$OUT/logs-$STAGE.tar.gz" "$STAGE"; cp "$LOGS/summary.txt" "$OUT/summary-$STAGE.txt" 2>/dev/null' EXIT

[ -d /tmp/vllm-site/vllm ] || { echo "vLLM is not staged in /tmp/vllm-site (see ../shared/device/README.md)"; exit 3; }
# squeezeserve on PYTHONPATH as the namespace package pyproject maps, plus the dist-info that declares the
# vllm.general_plugins entry point (what `pip install squeezeserve` would write).
SITE=/tmp/sqsite
mkdir -p "$SITE/squeezeserve" "$SITE/squeezeserve-0.1.0.dist-info"
ln -sfn "$REPO/kernels" "$SITE/squeezeserve/kernels"
ln -sfn "$REPO/service" "$SITE/squeezeserve/service"
printf 'Metadata-Version: 2.1\nName: squeezeserve\nVersion: 0.1.0\n' > "$SITE/squeezeserve-0.1.0.dist-info/METADATA"
printf '[vllm.general_plugins]\nsqueezeserve = squeezeserve.service.worker.vllm_plugin:register\n' \
  > "$SITE/squeezeserve-0.1.0.dist-info/entry_points.txt"
export PYTHONPATH="$SITE:/tmp/vllm-site" VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
  PYTHONUNBUFFERED=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 SQUEEZESERVE_VLLM_PROBE="$LOGS/probe.log"
VERSIONS=$(python3 -c "import importlib.metadata as m, torch, triton; print(f'vllm {m.version(\"vllm\")}; torch {torch.__version__}; triton {triton.__version__}')" 2>/dev/null)
DEVICE=$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1)
export BENCH_VERSIONS="$VERSIONS" BENCH_DEVICE="$DEVICE"
echo "device: $DEVICE; $VERSIONS" | tee -a "$LOGS/summary.txt"
SQ="python3 -m squeezeserve.service.cli"

wait_healthy() {  # url pid timeout
  local t=0
  until curl -sf "$1/health" >/dev/null 2>&1; do
    kill -0 "$2" 2>/dev/null || { echo "process $2 exited before $1 was healthy"; return 1; }
    sleep 2; t=$((t + 2)); [ "$t" -ge "$3" ] && { echo "$1 not healthy after $3 s"; return 1; }
  done
  echo "healthy after ${t}s: $1"
}

stop() {  # pid: the process group a setsid start made
  kill -INT -- "-$1" 2>/dev/null; for _ in $(seq 30); do kill -0 "$1" 2>/dev/null || return 0; sleep 1; done
  kill -KILL -- "-$1" 2>/dev/null; sleep 2
}

serve_and_bench() {  # label run model_dir served_name vocab [vllm args...]
  local label=$1 run=$2 model=$3 name=$4 vocab=$5; shift 5
  local t0=$SECONDS
  setsid taskset -c 0-7 $SQ worker --engine vllm --model "$model" --served-model-name "$name" --port 8101 -- "$@" \
    > "$LOGS/worker-$label.log" 2>&1 &
  local wpid=$!
  STARTED+=("$wpid")
  if wait_healthy http://127.0.0.1:8101 "$wpid" "${START_TIMEOUT:-400}"; then
    echo "$label: worker up in $((SECONDS - t0)) s" | tee -a "$LOGS/summary.txt"
    local url=http://127.0.0.1:8100  # through our gateway; straight to the worker only if the gateway is down
    curl -sf "$url/v1/models" >/dev/null || { url=http://127.0.0.1:8101; echo "$label: gateway down, direct" | tee -a "$LOGS/summary.txt"; }
    python3 tests/benchmarks/bench_serving.py --base-url "$url" --model "$name" --run "$run" \
      --label "$label" --vocab "$vocab" --concurrency ${CONCURRENCY:-1 16 64} --csv "$CSV" \
      ${BENCH_ARGS:-} 2>&1 | tee -a "$LOGS/summary.txt"
    if [ -n "${VALIDATE:-}" ]; then  # accuracy of the served candidate vs the fp16 baseline (local, on the GPU)
      timeout 120 $SQ validate --baseline /tmp/model/hf --candidate "$url#$name" --tokenizer /tmp/model/hf \
        --dataset .vllm-bundle/data/test.txt --max-tokens 16384 --skip-latency --device cuda --dtype float16 \
        --out "$LOGS/validate-$label" > "$LOGS/validate-$label.log" 2>&1
      tail -n 15 "$LOGS/validate-$label.log" | tee -a "$LOGS/summary.txt"
    fi
  else
    tail -40 "$LOGS/worker-$label.log"
  fi
  grep -E "squeezeserve plugin|Using .* for CompressedTensorsWNA16|Error|error" "$LOGS/worker-$label.log" | head -8
  stop "$wpid"
}

start_gateway() {
  setsid $SQ gateway --upstream http://127.0.0.1:8101 --port 8100 --health-interval 1 > "$LOGS/gateway.log" 2>&1 &
  GATEWAY=$!
  STARTED+=("$GATEWAY")
  sleep 3
}

prepare_models() {  # the bundled baseline (fp16) now; int8 and int4 compressed in the background (CPUs 8-15)
  if [ ! -f /tmp/model/hf/config.json ]; then
    python3 /tmp/vllm-tools/vllm_smoke.py convert --gguf /tmp/b/smollm2.gguf --out /tmp/model/hf > "$LOGS/convert.log" 2>&1 \
      || { tail -20 "$LOGS/convert.log"; exit 1; }
  fi
  ( [ -f /tmp/model/int8/config.json ] || taskset -c 8-15 $SQ compress --model /tmp/model/hf --method int8 \
      --out /tmp/model/int8 --overwrite > "$LOGS/compress-int8.log" 2>&1
    [ -f /tmp/model/int4/config.json ] || timeout 300 taskset -c 8-15 $SQ compress --model /tmp/model/hf --method int4 \
      --out /tmp/model/int4 --overwrite --calibration .vllm-bundle/data/calibration.txt --calibration-samples 64 \
      > "$LOGS/compress-int4.log" 2>&1 ) &
  CPID=$!
}

case "$STAGE" in
ab)
  prepare_models
  for cfg in on off; do
    if [ "$cfg" = off ]; then export SQUEEZESERVE_VLLM_SILU_AND_MUL=0 SQUEEZESERVE_VLLM_RMS_NORM=0; fi
    timeout 200 taskset -c 0-7 python3 tests/gpu/vllm_ab.py --model /tmp/model/hf --label "$cfg" --out "$OUT/ab-$cfg.json" > "$LOGS/ab-$cfg.log" 2>&1 \
      || tail -30 "$LOGS/ab-$cfg.log"
    grep -E '^\{"label|^greedy' "$LOGS/ab-$cfg.log"
  done
  unset SQUEEZESERVE_VLLM_SILU_AND_MUL SQUEEZESERVE_VLLM_RMS_NORM
  python3 tests/gpu/vllm_ab.py --compare "$OUT/ab-off.json" "$OUT/ab-on.json" --csv "$OUT/vllm_ops_ab.csv" | tee -a "$LOGS/summary.txt"
  wait "$CPID"; tail -n 2 "$LOGS/compress-int8.log" "$LOGS/compress-int4.log"
  # The quantization method in the engine: the int4 checkpoint by vLLM's kernels, then by quant_matmul.
  for cfg in int4-vllm int4-squeezeserve; do
    q=(); [ "$cfg" = int4-squeezeserve ] && q=(--quantization squeezeserve)
    timeout 200 python3 tests/gpu/vllm_ab.py --model /tmp/model/int4 "${q[@]}" --label "$cfg" --out "$OUT/ab-$cfg.json" \
      > "$LOGS/ab-$cfg.log" 2>&1 || tail -30 "$LOGS/ab-$cfg.log"
    grep -E '^\{"label|^greedy' "$LOGS/ab-$cfg.log"
  done
  python3 tests/gpu/vllm_ab.py --compare "$OUT/ab-int4-vllm.json" "$OUT/ab-int4-squeezeserve.json" --csv "$OUT/vllm_ops_ab.csv" | tee -a "$LOGS/summary.txt"
  ;;
ckpt)
  prepare_models
  start_gateway
  COMMON=(--dtype float16 --gpu-memory-utilization 0.3 --max-model-len 2048 --max-num-seqs 64)
  serve_and_bench baseline run1 /tmp/model/hf smollm2 49152 "${COMMON[@]}"
  wait "$CPID"; tail -n 2 "$LOGS/compress-int8.log" "$LOGS/compress-int4.log"
  for ckpt in ${CKPTS:-int8 int4}; do
    serve_and_bench "$ckpt-vllm" run1 "/tmp/model/$ckpt" smollm2 49152 "${COMMON[@]}"
  done
  if [ -n "${WITH_OURS:-}" ]; then
    serve_and_bench int4-squeezeserve run1 /tmp/model/int4 smollm2 49152 "${COMMON[@]}" --quantization squeezeserve
  fi
  stop "$GATEWAY"
  ;;
synth)
  python3 tests/gpu/synthetic_llama.py --tokenizer /tmp/model/hf --out /tmp/model/llama8b-bf16
  python3 tests/gpu/synthetic_llama.py --tokenizer /tmp/model/hf --out /tmp/model/llama8b-w4a16 --w4a16
  start_gateway
  # No torch.compile (its 8B compile would not fit three servers in one 10-minute call); decode steps still
  # replay full CUDA graphs, so TPOT is not host-bound.
  COMMON=(--dtype bfloat16 --load-format dummy --gpu-memory-utilization 0.85 --max-model-len 2048 --max-num-seqs 64
          --compilation-config '{"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}')
  serve_and_bench bf16 run2 /tmp/model/llama8b-bf16 llama8b 49152 "${COMMON[@]}"
  serve_and_bench w4a16-vllm run2 /tmp/model/llama8b-w4a16 llama8b 49152 "${COMMON[@]}"
  serve_and_bench w4a16-squeezeserve run2 /tmp/model/llama8b-w4a16 llama8b 49152 "${COMMON[@]}" --quantization squeezeserve
  stop "$GATEWAY"
  ;;
*) echo "unknown stage $STAGE"; exit 2 ;;
esac
[ -f "$LOGS/probe.log" ] && sort -t' ' -k2,2 -k1,1 "$LOGS/probe.log" | head -40
exit 0
