#!/usr/bin/env bash
# vLLM with squeezeserve inside, on the lent H100 (issue 6). Runs on the device machine from the repo root,
# after vLLM 0.26.0 was unpacked into /tmp/vllm-site and the bundled GGUF into /tmp/b/smollm2.gguf
# (../shared/device/README.md). Each stage fits one 10-minute call; CSV, summary and a log tarball go to $OUT.
#
#   bash tests/gpu/run_h100.sh prep    # (staging call 5) GGUF -> fp16 baseline; compress int8, int4, fp8
#   bash tests/gpu/run_h100.sh ab      # run 3: our ops on vs off (+ int4 by Marlin vs quant_matmul), CPUs clean
#   bash tests/gpu/run_h100.sh ckpt    # run 1: baseline/int8/int4/fp8 by vLLM behind our gateway + validate
#   bash tests/gpu/run_h100.sh synth   # run 2: 8B-class synthetic Llama: bf16 / W4A16 vLLM / W4A16 ours
#   bash tests/gpu/run_h100.sh synth-compiled  # the same in vLLM's default (compiled) configuration
#   bash tests/gpu/run_h100.sh ttft    # issue 16.3: synth's three configurations in-process, TTFT profiled
#   bash tests/gpu/run_h100.sh ttft-compiled  # the same in vLLM's compiled configuration (piecewise CUDA graphs)
#   bash tests/gpu/run_h100.sh disconnect  # issue 15.3: streams closed after ~1 s of reading stop vLLM within 1 s
#   bash tests/gpu/run_h100.sh serve-pruned  # issue 19.4 in one call: vLLM speed of the recipe's shapes (below)
#   bash tests/gpu/run_h100.sh int4-serve    # issue 16.3: bundled int4 g32 through our method vs vLLM's kernels
#                                            # (ROUNDS=N: N interleaved rounds, each server alone on 12 CPUs)
#   bash tests/gpu/run_h100.sh ttft-burst    # issue 16.3: TTFT under load, 64 prompts at once, profiled (BURST)
#   bash tests/gpu/run_h100.sh serve-prof    # issue 16.3: ours / Machete served, vLLM's profiler on (engine steps)
#   bash tests/gpu/run_h100.sh pdl-ab        # issue 16.3: 8B-shaped W4A16, ours with the PDL chain on / off and
#                                            # Machete, interleaved rounds on one lease (ROUNDS, MODE=mode0)
#   bash tests/gpu/run_h100.sh int8    # issue 19.5: int8 RTN vs GPTQ on the whole wikitext-2 test file
#   bash tests/gpu/run_h100.sh recipes # issue 19: mlp-width ratios x kd/lm recovery, prune -> kd -> int4, vLLM speed
#                                      # (resumable: run it again until it says 'recipes complete')
#
# Two GPUs (nvidia-h200-x2, issue 18; `prep` first, as above):
#   bash tests/gpu/run_h100.sh tp       # bundled (cut to 6 heads) fp16 / int4 ours, TP=1 vs 2: greedy, kernels per rank
#   bash tests/gpu/run_h100.sh tp8b     # 8B-shaped W4A16 through our method: TPOT at c=1/64, TP=1 vs TP=2
#   bash tests/gpu/run_h100.sh scale    # two 8B-shaped bf16 replicas behind the gateway: throughput, kill, prefix routing
#
# Data: .vllm-bundle/data/{calibration,test}.txt (wikitext-2, carried in the prep call, kept in /tmp/model).
# The gateway needs orjson, which the vLLM bundle lacks: carry .vllm-bundle/extra (`pip download --no-deps
# --only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_17_x86_64 -d
# .vllm-bundle/extra orjson`) once and `python3 -m zipfile -e .vllm-bundle/extra/orjson-*.whl /tmp/vllm-site/`.
# Servers start side by side (one GPU, each with a fixed --kv-cache-memory-bytes, so no server sizes its KV
# cache from memory another one is still allocating), each pinned to its own CPUs; measurements run one
# server at a time while the others sit idle. One failing configuration leaves the others measured.
set -uo pipefail
STAGE=${1:?usage: run_h100.sh prep|ab|ckpt|synth|synth-compiled|ttft|ttft-compiled|ttft-burst|serve-prof|disconnect|serve-pruned|int4-serve|pdl-ab|int8|recipes|tp|tp8b|scale}
OUT=${OUT:-/tmp/vllm-out}
LOGS=/tmp/vllm-logs/$STAGE
mkdir -p "$OUT" "$LOGS"
SUMMARY="$LOGS/summary.txt"
STARTED=()
# Servers run in their own sessions (setsid) and would outlive this script: stop them on any exit, then
# bring back the logs ($OUT returns few files: logs travel as one tarball).
trap 'for p in "${STARTED[@]}"; do kill -KILL -- "-$p" 2>/dev/null; done
      tar -C /tmp/vllm-logs -czf "$OUT/logs-$STAGE.tar.gz" "$STAGE"; cp "$SUMMARY" "$OUT/summary-$STAGE.txt"' EXIT
note() { echo "[$(date +%T) +${SECONDS}s] $*" | tee -a "$SUMMARY"; }
# The device call dies at 600 s: every step's timeout is capped so the stage ends by $BUDGET_S with its
# files written. cap N: min(N, seconds left); a step with under 20 s left is skipped (a 1 s timeout fails it).
BUDGET_S=${BUDGET_S:-540}
cap() { local left=$((BUDGET_S - SECONDS)); [ "$left" -lt 20 ] && left=1; echo $(( $1 < left ? $1 : left )); }

[ -d /tmp/vllm-site/vllm ] || { note "vLLM is not staged in /tmp/vllm-site (../shared/device/README.md)"; exit 3; }
# squeezeserve on PYTHONPATH as the namespace package pyproject maps, plus the dist-info that declares the
# vllm.general_plugins entry point (what `pip install squeezeserve` would write).
SITE=/tmp/sqsite
mkdir -p "$SITE/squeezeserve" "$SITE/squeezeserve-0.1.0.dist-info"
ln -sfn "$PWD/kernels" "$SITE/squeezeserve/kernels"
ln -sfn "$PWD/service" "$SITE/squeezeserve/service"
printf 'Metadata-Version: 2.1\nName: squeezeserve\nVersion: 0.1.0\n' > "$SITE/squeezeserve-0.1.0.dist-info/METADATA"
printf '[vllm.general_plugins]\nsqueezeserve = squeezeserve.service.worker.vllm_plugin:register\n' \
  > "$SITE/squeezeserve-0.1.0.dist-info/entry_points.txt"
export PYTHONPATH="$SITE:/tmp/vllm-site" VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
  PYTHONUNBUFFERED=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 SQUEEZESERVE_VLLM_PROBE="$LOGS/probe.log"
VERSIONS=$(python3 -c "import importlib.metadata as m, torch, triton; print(f'vllm {m.version(\"vllm\")}; torch {torch.__version__}; triton {triton.__version__}')" 2>/dev/null)
DEVICE=$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1)
export BENCH_VERSIONS="$VERSIONS" BENCH_DEVICE="$DEVICE"
note "stage $STAGE; device: $DEVICE; $VERSIONS"
SQ="python3 -m squeezeserve.service.cli"
MODELS=/tmp/model
DATA=$MODELS/data
GW=http://127.0.0.1:8100

declare -A PID PORT T0 CPUS
start_server() {  # label cpus port model [vLLM args...]; served as $NAME or <label>; GPUS=0,1 picks GPUs
  local label=$1 cpus=$2 port=$3 model=$4; shift 4
  [ -f "$model/config.json" ] || { note "$label: no checkpoint at $model, skipped"; return 1; }
  # CACHES=dir: each server compiles into a cache of its own (servers compiling side by side)
  local cache=${VLLM_CACHE_ROOT:-$HOME/.cache/vllm}
  [ -n "${CACHES:-}" ] && cache=$CACHES/$label
  CUDA_VISIBLE_DEVICES=${GPUS:-0} VLLM_CACHE_ROOT=$cache setsid taskset -c "$cpus" $SQ worker --engine vllm --model "$model" --served-model-name "${NAME:-$label}" \
    --port "$port" -- "$@" > "$LOGS/worker-$label.log" 2>&1 &
  PID[$label]=$!; PORT[$label]=$port; T0[$label]=$SECONDS; CPUS[$label]=$cpus; STARTED+=("$!")
}

pin() {  # label cpus: every thread of every process of the label's server onto cpus
  local proc
  for proc in $(pgrep -g "${PID[$1]}"); do taskset -a -p -c "$2" "$proc" > /dev/null 2>&1; done
}

bench_alone() {  # run csv label...: each label's server measured alone (the others idle) at c=1 and c=64
  # WIDE_CPUS (e.g. 0-11): the measured server runs on those CPUs for its measurement, then back on its own
  # (its front end, engine and our ops' host work otherwise share the 3 CPUs it was started on). BENCH_SEED:
  # the prompts' seed; a second pass over the same servers needs another, or vLLM's prefix cache holds every
  # prompt of the first (seventeenth session's int4-serve j-k: a pass at c=1 ran 1 token a step, its prompts
  # cached, against 3 in the first)
  local run=$1 csv=$2; shift 2
  for label in "$@"; do
    [ -n "${WIDE_CPUS:-}" ] && pin "$label" "$WIDE_CPUS"
    timeout "$(cap 90)" taskset -c 12-15 python3 tests/benchmarks/bench_serving.py \
      --base-url "http://127.0.0.1:${PORT[$label]}" --model "$label" --run "$run" --label "$label" \
      --vocab 49152 --concurrency 1 64 --prompt-tokens 256 --output-tokens 128 --seed "${BENCH_SEED:-0}" \
      --csv "$csv" 2>&1 | tee -a "$SUMMARY"
    [ -n "${WIDE_CPUS:-}" ] && pin "$label" "${CPUS[$label]}"
  done
}

wait_servers() {  # timeout_s label...: every label healthy, dead or timed out; prints the healthy ones
  local limit=$1; shift
  local pending=("$@") up=()
  while [ ${#pending[@]} -gt 0 ]; do
    local next=()
    for label in "${pending[@]}"; do
      if curl -sf "http://127.0.0.1:${PORT[$label]}/health" >/dev/null 2>&1; then
        note "$label: healthy after $((SECONDS - T0[$label])) s" >&2; up+=("$label")
      elif ! kill -0 "${PID[$label]}" 2>/dev/null; then
        note "$label: exited before it was healthy; log tail:" >&2; tail -25 "$LOGS/worker-$label.log" >&2
      elif [ $((SECONDS - T0[$label])) -ge "$limit" ]; then
        note "$label: not healthy after $limit s; stopped" >&2; kill -KILL -- "-${PID[$label]}" 2>/dev/null
      else
        next+=("$label")
      fi
    done
    pending=("${next[@]}")
    [ ${#pending[@]} -gt 0 ] && sleep 2
  done
  echo "${up[@]}"
}

start_gateway() {  # cpus port...; GW_PORT picks the gateway's own port (default 8100)
  local cpus=$1; shift
  local upstreams=()
  for port in "$@"; do upstreams+=(--upstream "http://127.0.0.1:$port"); done
  setsid taskset -c "$cpus" $SQ gateway "${upstreams[@]}" --port "${GW_PORT:-8100}" --health-interval 1 \
    --max-inflight-per-upstream 512 > "$LOGS/gateway-${GW_PORT:-8100}.log" 2>&1 &
  STARTED+=("$!")
}

stop_server() {  # label: SIGKILL its process group (vLLM's engine and workers with it), wait for the GPU
  kill -KILL -- "-${PID[$1]}" 2>/dev/null; sleep 5
}

greedy_and_profile() {  # label: 8 greedy completions inside a torch-profiler window -> $LOGS/greedy-<label>.json
  local base="http://127.0.0.1:${PORT[$1]}"
  curl -sf -X POST "$base/start_profile" >/dev/null || note "$1: start_profile failed"
  python3 - "$base" "$1" "$LOGS/greedy-$1.json" <<'PY'
import json, sys, httpx
base, label, out = sys.argv[1:]
prompts = ["The capital of France is", "Write one sentence about the sea:", "def fibonacci(n):",
           "Three primary colours are", "The theory of relativity says that", "A good breakfast contains",
           "Translate to French: good morning", "List three prime numbers:"]
texts = []
for p in prompts:
    r = httpx.post(f"{base}/v1/completions", json={"model": label, "prompt": p, "max_tokens": 48,
                                                  "temperature": 0}, timeout=120)
    texts.append(r.json()["choices"][0]["text"])
json.dump(texts, open(out, "w"))
PY
  curl -sf -X POST "$base/stop_profile" >/dev/null || note "$1: stop_profile failed"
}

count_kernels() {  # dir: our Triton kernels per profiler trace (one trace per engine process)
  python3 - "$1" <<'PY' | tee -a "$SUMMARY"
import collections, gzip, json, pathlib, sys
ours = ("_swiglu_fwd", "_rmsnorm_fwd", "_gemv_int4_kernel", "_gemv_kernel", "_skinny_kernel", "_dequantize_kernel")
for trace in sorted(pathlib.Path(sys.argv[1]).rglob("*.json*")):
    opener = gzip.open if trace.suffix == ".gz" else open
    try:
        events = json.load(opener(trace, "rt")).get("traceEvents", [])
    except Exception as exc:
        print(f"{trace.name}: unreadable ({exc})"); continue
    counts = collections.Counter(e.get("name") for e in events if e.get("cat") == "kernel" and e.get("name") in ours)
    print(f"{trace.parent.name}/{trace.name}: {dict(counts) or 'none of ours'}")
PY
}

convert_baseline() {  # the bundled GGUF -> fp16 checkpoint in $MODELS/hf (once per machine)
  [ -f $MODELS/hf/config.json ] && return 0
  timeout "$(cap 200)" python3 /tmp/vllm-tools/vllm_smoke.py convert --gguf /tmp/b/smollm2.gguf --out $MODELS/hf \
    > "$LOGS/convert.log" 2>&1 || { tail -20 "$LOGS/convert.log"; exit 1; }
}

compress_int4_rtn() {  # the bundled model's int4 g32 checkpoint by RTN into $MODELS/int4-rtn (int4-serve's)
  timeout "$(cap 120)" $SQ compress --model $MODELS/hf --method int4 --algorithm rtn --out $MODELS/int4-rtn \
    --overwrite > "$LOGS/compress-int4-rtn.log" 2>&1
  note "int4-rtn (g32): exit $?; $(tail -n 1 "$LOGS/compress-int4-rtn.log")"
}

stage_data() {  # wikitext-2 from the carried .vllm-bundle/data into $DATA (once per machine)
  [ -f $DATA/test.txt ] && [ -f $DATA/calibration.txt ] && return 0
  mkdir -p "$DATA" && cp .vllm-bundle/data/calibration.txt .vllm-bundle/data/test.txt "$DATA/" \
    || { note "carry .vllm-bundle/data with this call"; exit 1; }
}

synth_args() {  # mode0|compiled: COMMON, the 8B-shaped servers' vLLM arguments (synth, synth-compiled, pdl-ab)
  # 4 GiB of KV each covers 64 sequences x 320 tokens (128 KiB a token).
  COMMON=(--dtype bfloat16 --load-format dummy --max-model-len 1024 --max-num-seqs 64 --gpu-memory-utilization 0.3
          --kv-cache-memory-bytes 4294967296)
  if [ "$1" = mode0 ]; then
    COMMON+=(--compilation-config '{"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}')
  else
    COMMON+=(--compilation-config '{"max_cudagraph_capture_size": 512}')
    export CACHES=/tmp/vllm-caches  # (each server compiles into a cache of its own)
  fi
}

gateway_serves() {  # label: wait (<= 20 s) until the gateway lists it
  for _ in $(seq 20); do
    curl -sf "$GW/v1/models" | grep -q "\"$1\"" && return 0; sleep 1
  done
  note "$1: the gateway does not list it"; return 1
}

case "$STAGE" in
prep)
  stage_data
  convert_baseline
  note "baseline converted"
  # GPTQ on the GPU where compress offers it (--device), else on 12 CPUs; int8/fp8 (RTN) on the rest.
  ON_GPU=(); $SQ compress --help | grep -q -- "--device" && ON_GPU=(--device cuda)
  ( timeout "$(cap 420)" taskset -c 0-11 $SQ compress --model $MODELS/hf --method int4 --out $MODELS/int4 --overwrite \
      --calibration $DATA/calibration.txt --calibration-samples 64 "${ON_GPU[@]}" > "$LOGS/compress-int4.log" 2>&1
    note "int4 (GPTQ g32, ${ON_GPU[*]:-cpu}): exit $?; $(tail -n 1 "$LOGS/compress-int4.log")" ) &
  for method in int8 fp8; do
    timeout "$(cap 200)" taskset -c 12-15 $SQ compress --model $MODELS/hf --method $method --out $MODELS/$method \
      --overwrite > "$LOGS/compress-$method.log" 2>&1
    note "$method: exit $?; $(tail -n 1 "$LOGS/compress-$method.log")"
  done
  wait
  du -sh $MODELS/* | tee -a "$SUMMARY"
  ;;
ab)
  # Run 3, alone on the machine. One configuration per process (the plugin reads its switches at load).
  AB=(--repeats 5)
  # AB_OPS=0 skips the ops on/off pair; AB_QUANT names the quantization configs (both by default).
  for cfg in $([ "${AB_OPS:-1}" = 1 ] && echo off on); do
    if [ "$cfg" = off ]; then sw=0; else sw=1; fi
    SQUEEZESERVE_VLLM_SILU_AND_MUL=$sw SQUEEZESERVE_VLLM_RMS_NORM=$sw timeout "$(cap 150)" python3 tests/gpu/vllm_ab.py \
      --model $MODELS/hf --label "$cfg" --out "$OUT/ab-$cfg.json" "${AB[@]}" > "$LOGS/ab-$cfg.log" 2>&1 \
      || { note "ab $cfg failed"; tail -30 "$LOGS/ab-$cfg.log"; }
    grep -E '^\{"label|^greedy' "$LOGS/ab-$cfg.log" | tee -a "$SUMMARY"
  done
  [ "${AB_OPS:-1}" = 1 ] && python3 tests/gpu/vllm_ab.py --compare "$OUT/ab-off.json" "$OUT/ab-on.json" \
    --csv "$OUT/vllm_ops_ab.csv" | tee -a "$SUMMARY"
  # The quantization method in the engine: the int4 checkpoint by vLLM's kernels, then by quant_matmul.
  for cfg in ${AB_QUANT:-int4-vllm int4-squeezeserve}; do
    q=(); [ "$cfg" = int4-squeezeserve ] && q=(--quantization squeezeserve)
    timeout "$(cap 110)" python3 tests/gpu/vllm_ab.py --model $MODELS/int4 "${q[@]}" --label "$cfg" \
      --out "$OUT/ab-$cfg.json" "${AB[@]}" > "$LOGS/ab-$cfg.log" 2>&1 || { note "ab $cfg failed"; tail -30 "$LOGS/ab-$cfg.log"; }
    grep -E '^\{"label|^greedy' "$LOGS/ab-$cfg.log" | tee -a "$SUMMARY"
  done
  [ -f "$OUT/ab-int4-vllm.json" ] && [ -f "$OUT/ab-int4-squeezeserve.json" ] && python3 tests/gpu/vllm_ab.py \
    --compare "$OUT/ab-int4-vllm.json" "$OUT/ab-int4-squeezeserve.json" --csv "$OUT/vllm_ops_ab.csv" | tee -a "$SUMMARY"
  ;;
ckpt)
  # Run 1. Four servers (compiled + CUDA graphs, our ops on), 3 CPUs each; gateway and clients on 12-15.
  COMMON=(--dtype float16 --max-model-len 1024 --max-num-seqs 64 --gpu-memory-utilization 0.1
          --kv-cache-memory-bytes 2147483648)
  CKPTS=(baseline:$MODELS/hf int8:$MODELS/int8 int4:$MODELS/int4 fp8:$MODELS/fp8)
  labels=(); ports=(); i=0
  for entry in "${CKPTS[@]}"; do
    label=${entry%%:*}; cpus="$((3 * i))-$((3 * i + 2))"; port=$((8101 + i)); i=$((i + 1))
    start_server "$label" "$cpus" "$port" "${entry#*:}" "${COMMON[@]}" && { labels+=("$label"); ports+=("$port"); }
  done
  start_gateway 12-13 "${ports[@]}"
  # While the servers start: exact KL / top-1 of each checkpoint vs the baseline, both in our loader on the
  # GPU (the endpoint gives top-k log-probs only, so KL over HTTP is not measured).
  for c in int8 int4 fp8; do
    [ -f $MODELS/$c/config.json ] || continue
    timeout "$(cap 120)" taskset -c 14-15 $SQ validate --baseline $MODELS/hf --candidate $MODELS/$c --dataset $DATA/test.txt \
      --max-tokens 16384 --skip-latency --device cuda --dtype float16 --out "$LOGS/kl-$c" > "$LOGS/kl-$c.log" 2>&1
    note "kl $c (local, exit $?): $(grep -E 'kl_mean|top1' "$LOGS/kl-$c/report.md" 2>/dev/null | tr -s ' ' | head -3 | tr '\n' ' ')"
  done
  read -r -a up <<< "$(wait_servers "$(cap "${START_TIMEOUT:-360}")" "${labels[@]}")"
  note "serving: ${up[*]}"
  LAT=(--concurrency 1,16,64 --prompt-tokens 256 --output-tokens 128 --warmup-requests 4)
  if [[ " ${up[*]} " == *" baseline "* ]] && gateway_serves baseline; then
    # The serving path itself: vLLM's fp16 baseline vs our fp16 scorer on the same checkpoint.
    timeout "$(cap 120)" taskset -c 14-15 $SQ validate --baseline $MODELS/hf --candidate "$GW#baseline" --tokenizer $MODELS/hf \
      --dataset $DATA/test.txt --max-tokens 16384 --skip-latency --device cuda --dtype float16 \
      --out "$LOGS/served-baseline" > "$LOGS/served-baseline.log" 2>&1
    note "served baseline vs local (exit $?)"
    for c in int8 int4 fp8; do
      [[ " ${up[*]} " == *" $c "* ]] && gateway_serves "$c" || continue
      # Accuracy (PPL, top-1 by token text) and latency of both sides, all through the gateway.
      timeout "$(cap 200)" taskset -c 14-15 $SQ validate --baseline "$GW#baseline" --candidate "$GW#$c" --tokenizer $MODELS/hf \
        --dataset $DATA/test.txt --max-tokens 16384 "${LAT[@]}" --out "$LOGS/validate-$c" > "$LOGS/validate-$c.log" 2>&1
      note "validate $c through the gateway (exit $?)"
    done
  fi
  python3 - "$LOGS" "$OUT/vllm_run1.csv" "$DEVICE" "$VERSIONS" <<'EOF' | tee -a "$SUMMARY"
import csv, json, sys, time
from pathlib import Path
logs, out, device, versions = Path(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
def metrics(name):
    path = logs / name / "report.json"
    return json.loads(path.read_text())["metrics"] if path.exists() else {}
rows = []
served_base = metrics("served-baseline")
for ckpt in ("baseline", "int8", "int4", "fp8"):
    served = metrics(f"validate-{ckpt}") if ckpt != "baseline" else {}
    local = metrics(f"kl-{ckpt}") if ckpt != "baseline" else {}
    side = "candidate" if ckpt != "baseline" else "baseline"
    source = served or metrics("validate-int8") or metrics("validate-int4") or metrics("validate-fp8")
    for c in (1, 16, 64):
        row = {"checkpoint": ckpt, "concurrency": c}
        for key, name in (("ttft_p50_ms", "ttft_p50_ms"), ("tpot_p50_ms", "tpot_p50_ms"),
                          ("output_tok_s", "output_throughput"), ("request_s", "request_throughput")):
            row[key] = source.get(f"{name}_{side}@c{c}")
        if ckpt == "baseline":
            row.update(ppl_served=served_base.get("ppl_candidate"), ppl_local_fp16=served_base.get("ppl_baseline"),
                       top1_served_vs_local=served_base.get("top1_agreement"))
        else:
            row.update(ppl_served=served.get("ppl_candidate"), ppl_baseline_served=served.get("ppl_baseline"),
                       ln_ppl_ratio_served=served.get("ln_ppl_ratio"), top1_served=served.get("top1_agreement"),
                       kl_mean_local=local.get("kl_mean"), kl_p99_local=local.get("kl_p99"),
                       top1_local=local.get("top1_agreement"), ppl_local=local.get("ppl_candidate"))
        rows.append({**row, "device": device, "versions": versions, "date": time.strftime("%Y-%m-%d", time.gmtime())})
fields = list(dict.fromkeys(k for r in rows for k in r))
with open(out, "w", newline="") as f:
    writer = csv.DictWriter(f, fieldnames=fields)
    writer.writeheader()
    writer.writerows(rows)
for r in rows:
    print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items() if k not in ("device", "versions")})
EOF
  ;;
synth|synth-compiled)
  convert_baseline  # (the tokenizer of the bundled model)
  python3 tests/gpu/synthetic_llama.py --tokenizer $MODELS/hf --out $MODELS/llama8b-bf16
  python3 tests/gpu/synthetic_llama.py --tokenizer $MODELS/hf --out $MODELS/llama8b-w4a16 --w4a16
  # synth: no torch.compile (it was thought that three 8B compiles would not fit one call); decode steps replay
  # full CUDA graphs, so TPOT is not host-bound, but prompts run eagerly (host-bound: NOTES.md, "ninth
  # session"). synth-compiled: what a production server on an H100 runs by vLLM's defaults: torch.compile, and
  # CUDA graphs up to 512 tokens (vLLM's min(2 x max_num_seqs, 512), its default max_num_seqs on an H100 being
  # 1024; --max-num-seqs 64 here, for the KV budget, would have cut it to 128 and left a 256-token prompt's
  # pieces without a graph: run 31). Servers healthy after ~2.5 min compiling side by side with cold caches,
  # each server into its own.
  if [ "$STAGE" = synth ]; then synth_args mode0; else synth_args compiled; fi
  start_server bf16 0-3 8201 $MODELS/llama8b-bf16 "${COMMON[@]}"
  start_server w4a16-vllm 4-7 8202 $MODELS/llama8b-w4a16 "${COMMON[@]}"
  start_server w4a16-squeezeserve 8-11 8203 $MODELS/llama8b-w4a16 "${COMMON[@]}" --quantization squeezeserve
  start_gateway 12-13 8201 8202 8203
  read -r -a up <<< "$(wait_servers "$(cap "${START_TIMEOUT:-400}")" bf16 w4a16-vllm w4a16-squeezeserve)"
  note "serving: ${up[*]}"
  for label in "${up[@]}"; do
    gateway_serves "$label" || continue
    timeout "$(cap 150)" taskset -c 14-15 python3 tests/benchmarks/bench_serving.py --base-url $GW --model "$label" \
      --run "${RUN:-run2}" --label "$label" --vocab 49152 --concurrency 1 16 64 --prompt-tokens 256 --output-tokens 64 \
      --metrics-root "http://127.0.0.1:${PORT[$label]}" --csv "$OUT/vllm_serving.csv" 2>&1 | tee -a "$SUMMARY"
    grep -E "Using .* for CompressedTensorsWNA16|squeezeserve plugin" "$LOGS/worker-$label.log" | head -3 | tee -a "$SUMMARY"
  done
  # TTFT at c=1 from 8 requests a server swung 26-57 ms for bf16 across runs 16-27: a second pass measures it
  # alone (2 output tokens), the servers in turn over 3 rounds so that drift spreads over all of them.
  for round in 1 2 3; do
    for label in "${up[@]}"; do
      timeout "$(cap 40)" taskset -c 14-15 python3 tests/benchmarks/bench_serving.py --base-url $GW --model "$label" \
        --run "${RUN:-run2}-ttft" --label "$label" --vocab 49152 --concurrency 1 --requests-per-level 16 \
        --warmup-requests 2 --seed "$round" --prompt-tokens 256 --output-tokens 2 --csv "$OUT/vllm_ttft.csv" 2>&1 \
        | tee -a "$SUMMARY"
    done
  done
  ;;
ttft)
  # Issue 16.3: synth's TTFT without HTTP, profiled (tests/gpu/ttft_probe.py): synth's three configurations
  # plus ours on the host path before launch plans, in-process, loading side by side (each pinned to its own
  # CPUs, as synth's servers), then taking turns (one measures, the others idle). Twice, the CPU sets
  # swapped between the pairs (synth pins its servers to fixed CPUs: a slower set would read as a slower method).
  python3 tests/gpu/synthetic_llama.py --tokenizer $MODELS/hf --out $MODELS/llama8b-bf16
  python3 tests/gpu/synthetic_llama.py --tokenizer $MODELS/hf --out $MODELS/llama8b-w4a16 --w4a16
  lscpu | grep -E "^(Model name|Thread|Core|Socket|NUMA node)" | tee -a "$SUMMARY"
  lscpu -e=CPU,CORE,SOCKET,NODE,MHZ | tr -s ' ' | paste -sd';' | tee -a "$SUMMARY"
  PEERS=bf16,w4a16-vllm,w4a16-squeezeserve,w4a16-squeezeserve-old
  probe() {  # label cpus model [probe args]
    local label=$1 cpus=$2 model=$3; shift 3
    timeout "$(cap 260)" taskset -c "$cpus" python3 tests/gpu/ttft_probe.py --model "$model" --label "$label" \
      --peers $PEERS --out "$LOGS" --tag="-cpu$cpus" "$@" > "$LOGS/probe-$label-cpu$cpus.log" 2>&1
    note "$label on CPUs $cpus: probe exit $?"
    grep -E "in-process engine|^anatomy|^  [a-z_]+_proj" "$LOGS/probe-$label-cpu$cpus.log" | tee -a "$SUMMARY"
  }
  for cpus in "0-3 4-7 8-11 12-15" "8-11 12-15 0-3 4-7"; do
    read -r c1 c2 c3 c4 <<< "$cpus"
    rm -rf /tmp/ttft_probe.sync
    probe bf16 "$c1" $MODELS/llama8b-bf16 &
    probe w4a16-vllm "$c2" $MODELS/llama8b-w4a16 &
    probe w4a16-squeezeserve "$c3" $MODELS/llama8b-w4a16 --quantization squeezeserve &
    SQUEEZESERVE_LAUNCH_PLANS=0 probe w4a16-squeezeserve-old "$c4" $MODELS/llama8b-w4a16 \
      --quantization squeezeserve --old-host-path &
    wait
  done  # the ttft-*.txt reports and traces travel in the log tarball
  ;;
ttft-compiled|ttft-burst)
  # Issue 16.3: the ttft stage's probe in vLLM's compiled configuration (ttft_probe.py --compiled: piecewise
  # CUDA graphs captured up to 256 tokens), synth's three configurations, each with its own compile cache.
  # ttft-burst, TTFT under load: at c=64 bench_serving's requests reach a server together (all ask for the
  # same number of tokens, so they start and end together), and the last of 64 256-token prompts waits for two
  # prompt steps of 8192 rows: 64 prompts a generation (BURST), the steps' kernels profiled.
  convert_baseline  # (the tokenizer of the bundled model)
  python3 tests/gpu/synthetic_llama.py --tokenizer $MODELS/hf --out $MODELS/llama8b-bf16
  python3 tests/gpu/synthetic_llama.py --tokenizer $MODELS/hf --out $MODELS/llama8b-w4a16 --w4a16
  PEERS=bf16,w4a16-vllm,w4a16-squeezeserve
  rm -rf /tmp/ttft_probe.sync
  EXTRA=()
  [ "$STAGE" = ttft-burst ] && EXTRA=(--burst "${BURST:-64}" --rounds 3 --repeats 3 --profile 2)
  cprobe() {  # label cpus model [probe args]
    local label=$1 cpus=$2 model=$3; shift 3
    VLLM_CACHE_ROOT=/tmp/vllm-cache-$STAGE-$label timeout "$(cap 520)" taskset -c "$cpus" python3 \
      tests/gpu/ttft_probe.py --model "$model" --label "$label" --peers $PEERS --out "$LOGS" --compiled \
      "${EXTRA[@]}" "$@" > "$LOGS/probe-$label.log" 2>&1
    note "$label: probe exit $?"; grep -E "in-process engine|^ttft/" "$LOGS/probe-$label.log" | tee -a "$SUMMARY"
    cp "$LOGS/ttft-$label.txt" "$OUT/" 2>/dev/null
  }
  cprobe bf16 0-4 $MODELS/llama8b-bf16 &
  cprobe w4a16-vllm 5-9 $MODELS/llama8b-w4a16 &
  cprobe w4a16-squeezeserve 10-14 $MODELS/llama8b-w4a16 --quantization squeezeserve &
  wait
  ;;
serve-prof)
  # Issue 16.3, TTFT under load in serving: ours (the chain) and Machete as synth-compiled serves them, each
  # server with vLLM's torch profiler (--profiler-config). Each measured alone on CPUs 0-11: an unprofiled
  # pass at c = 16 and 64 (first-call costs), then a profiled one (PROF_C, PROF_REQUESTS requests a level),
  # its engine steps read back by tests/gpu/serve_trace.py (steps by rows; the prompt and decode steps'
  # kernels). PROF_MODEL=bundled: the bundled model's int4 g32 checkpoint (int4-serve's), ours against Marlin
  # (Machete disabled), passes at c = 1 and 64, the profiled one at c=1 (the c=1 question: GPU time a step).
  convert_baseline  # (the tokenizer of the bundled model)
  prof() { printf '{"profiler": "torch", "torch_profiler_dir": "/tmp/prof/%s", "torch_profiler_with_stack": false, "ignore_frontend": true}' "$1"; }
  rm -rf /tmp/prof
  if [ "${PROF_MODEL:-8b}" = bundled ]; then
    compress_int4_rtn
    COMMON=(--dtype float16 --max-model-len 1024 --max-num-seqs 64 --gpu-memory-utilization 0.1
            --kv-cache-memory-bytes 2147483648)
    PEER=int4-marlin OURS=int4-squeezeserve MODEL=$MODELS/int4-rtn WARM_C="1 64" PROF_DEFAULT_C=1
    mkdir -p /tmp/prof/$PEER /tmp/prof/$OURS
    VLLM_DISABLED_KERNELS=MacheteLinearKernel,CutlassW4A8LinearKernel \
      start_server $PEER 0-3 8202 "$MODEL" "${COMMON[@]}" --profiler-config "$(prof $PEER)"
  else
    python3 tests/gpu/synthetic_llama.py --tokenizer $MODELS/hf --out $MODELS/llama8b-w4a16 --w4a16
    synth_args compiled
    PEER=w4a16-vllm OURS=chain MODEL=$MODELS/llama8b-w4a16 WARM_C="16 64" PROF_DEFAULT_C="16 64"
    mkdir -p /tmp/prof/$PEER /tmp/prof/$OURS
    start_server $PEER 0-3 8202 "$MODEL" "${COMMON[@]}" --profiler-config "$(prof $PEER)"
  fi
  start_server $OURS 4-7 8203 "$MODEL" "${COMMON[@]}" --quantization squeezeserve --profiler-config "$(prof $OURS)"
  read -r -a up <<< "$(wait_servers "$(cap "${START_TIMEOUT:-400}")" $PEER $OURS)"
  note "serving: ${up[*]}"
  [ ${#up[@]} -gt 0 ] || exit 1
  for label in "${up[@]}"; do
    url="http://127.0.0.1:${PORT[$label]}"
    pin "$label" 0-11
    for pass in warm prof; do
      conc=$WARM_C requests=0 seed=1
      if [ $pass = prof ]; then
        conc=${PROF_C:-$PROF_DEFAULT_C} requests=${PROF_REQUESTS:-64} seed=2
        curl -sf -X POST "$url/start_profile" > /dev/null || note "$label: start_profile failed"
      fi
      timeout "$(cap 100)" taskset -c 12-15 python3 tests/benchmarks/bench_serving.py --base-url "$url" \
        --model "$label" --run "${RUN:-serve-prof}-$pass" --label "$label" --vocab 49152 --concurrency $conc \
        --prompt-tokens 256 --output-tokens 64 --requests-per-level "$requests" --seed "$seed" \
        --metrics-root "$url" --csv "$OUT/vllm_serve_prof.csv" 2>&1 | tee -a "$SUMMARY"
    done
    curl -sf -X POST --max-time "$(cap 120)" "$url/stop_profile" > /dev/null || note "$label: stop_profile failed"
    note "$label: profile stopped"
    pin "$label" "${CPUS[$label]}"
  done
  for label in "${up[@]}"; do
    for _ in $(seq 60); do compgen -G "/tmp/prof/$label/*.pt.trace.json*" > /dev/null && break; sleep 1; done
    ls -la /tmp/prof/$label | tee -a "$SUMMARY"
    cp /tmp/prof/$label/profiler_out_0.txt "$OUT/profiler_out-$label.txt" 2>/dev/null
    timeout "$(cap 150)" python3 tests/gpu/serve_trace.py /tmp/prof/$label --label "$label" --by-size 8 2>&1 \
      | tee "$OUT/serve_trace-$label.txt" | tee -a "$SUMMARY"
  done
  ;;
disconnect)
  # Issue 15.3: vLLM (our plugin loaded) serves the baseline, our gateway in front; tests/gpu/vllm_disconnect.py
  # hangs up streams after 5 events, straight to vLLM and through the gateway, and reads vLLM's /metrics.
  convert_baseline
  start_server baseline 0-7 8001 $MODELS/hf --gpu-memory-utilization 0.3 --max-model-len 8192
  start_gateway 8-9 8001
  read -r -a up <<< "$(wait_servers "$(cap 300)" baseline)"
  [ "${#up[@]}" -eq 1 ] && gateway_serves baseline || exit 1
  # GPU utilisation every 100 ms beside it: a second witness of when decoding stopped (hung_up_at: epoch s)
  nvidia-smi --query-gpu=timestamp,utilization.gpu --format=csv,noheader -lms 100 > "$OUT/gpu_util.csv" &
  STARTED+=("$!")
  timeout "$(cap 200)" taskset -c 10-11 python3 tests/gpu/vllm_disconnect.py --worker http://127.0.0.1:8001 \
    --gateway $GW --model baseline --trials 5 --csv "$OUT/vllm_disconnect.csv" 2>&1 | tee -a "$SUMMARY"
  grep -E "squeezeserve plugin|Aborted request|abort" "$LOGS/worker-baseline.log" | head -12 | tee -a "$SUMMARY"
  ;;
serve-pruned)
  # Issue 19.4's serving half without the training: serving speed depends on the shapes and the format, not
  # on the recovered weights, so pruned checkpoints with no recovery (and them in int4 RTN: the recipe's
  # GPTQ writes the same tensors) stand in for the recipes' models. SHAPES lists "structure ratio" pairs
  # ('|'-separated); each is served in fp16 and int4 (vLLM's own W4A16 kernels) beside the baseline, with
  # the recipes stage's vLLM settings, and measured alone at c=1 and c=64.
  convert_baseline
  stage_data
  IFS='|' read -r -a SHAPE_LIST <<< "${SHAPES:-mlp-width 0.25|layers 0.25}"
  COMMON=(--dtype float16 --max-model-len 1024 --max-num-seqs 64 --gpu-memory-utilization 0.1
          --kv-cache-memory-bytes 2147483648)
  declare -A SERVE=([baseline]=$MODELS/hf)
  for shape in "${SHAPE_LIST[@]}"; do
    read -r structure ratio <<< "$shape"
    P=$MODELS/${structure%%-*}$ratio
    timeout "$(cap 120)" $SQ compress --model $MODELS/hf --method prune --structure "$structure" --ratio "$ratio" \
      --out "$P" --calibration $DATA/calibration.txt --device cuda --overwrite > "$LOGS/compress-$(basename "$P").log" 2>&1
    note "$(basename "$P"): prune exit $?; $(tail -n 1 "$LOGS/compress-$(basename "$P").log")"
    timeout "$(cap 120)" $SQ compress --model "$P" --method int4 --algorithm rtn --out "$P-int4" --overwrite \
      > "$LOGS/compress-$(basename "$P")-int4.log" 2>&1
    note "$(basename "$P")-int4: exit $?; $(tail -n 1 "$LOGS/compress-$(basename "$P")-int4.log")"
    SERVE[$(basename "$P")]=$P; SERVE[$(basename "$P")-int4]=$P-int4
  done
  labels=(); i=0
  for label in "${!SERVE[@]}"; do  # 3 CPUs each (5 servers: 0-14), the client on 12-15
    start_server "$label" "$((3 * i))-$((3 * i + 2))" $((8601 + i)) "${SERVE[$label]}" "${COMMON[@]}" && labels+=("$label")
    i=$((i + 1))
  done
  read -r -a up <<< "$(wait_servers "$(cap 300)" "${labels[@]}")"
  note "serving: ${up[*]}"
  order=()  # the baseline first and again last: the drift between its two rows bounds the noise
  for label in "${up[@]}"; do [ "$label" = baseline ] || order+=("$label"); done
  [[ " ${up[*]} " == *" baseline "* ]] && order=(baseline "${order[@]}" baseline)
  bench_alone serve-pruned "$OUT/serve_pruned.csv" "${order[@]}"
  ;;
int4-serve)
  # Issue 16 item 3's second half: the bundled model's int4 g32 checkpoint (RTN: the same tensors GPTQ
  # writes, so the same serving speed) through our method vs through vLLM's own W4A16 kernels (its default
  # choice, and Marlin with Machete disabled), beside the fp16 baseline, each measured alone at c=1 and c=64.
  convert_baseline
  compress_int4_rtn
  COMMON=(--dtype float16 --max-model-len 1024 --max-num-seqs 64 --gpu-memory-utilization 0.1
          --kv-cache-memory-bytes 2147483648)
  labels=()
  start_server baseline 0-2 8701 $MODELS/hf "${COMMON[@]}" && labels+=(baseline)
  start_server int4-vllm 3-5 8702 $MODELS/int4-rtn "${COMMON[@]}" && labels+=(int4-vllm)
  VLLM_DISABLED_KERNELS=MacheteLinearKernel,CutlassW4A8LinearKernel \
    start_server int4-marlin 6-8 8703 $MODELS/int4-rtn "${COMMON[@]}" && labels+=(int4-marlin)
  start_server int4-squeezeserve 9-11 8704 $MODELS/int4-rtn "${COMMON[@]}" --quantization squeezeserve \
    && labels+=(int4-squeezeserve)
  read -r -a up <<< "$(wait_servers "$(cap 300)" "${labels[@]}")"
  note "serving: ${up[*]}"
  for label in int4-vllm int4-marlin; do  # the W4A16 kernel vLLM picked (ours: --quantization squeezeserve)
    note "$label: $(grep -m1 -oE 'Using [A-Za-z0-9]+LinearKernel' "$LOGS/worker-$label.log" || echo 'no kernel line')"
  done
  if [ -n "${ROUNDS:-}" ]; then
    # ROUNDS=N: N interleaved rounds, as pdl-ab's: every server measured alone on CPUs 0-11 a round, with the
    # round's own prompts (seed), the order rotated a round, so that neither a lease's drift nor a slot
    # favours a server (its c=1 steps are host-bound: one pass a server on a noisy lease settles nothing).
    # SEED_BASE: the first round's seed less one (another run on the same lease: other prompts)
    for round in $(seq "$ROUNDS"); do
      shift_by=$(( (round - 1) % ${#up[@]} ))
      WIDE_CPUS=0-11 BENCH_SEED=$((round + ${SEED_BASE:-0})) bench_alone "${RUN:-int4-serve}-r$round" \
        "$OUT/int4_serve.csv" "${up[@]:shift_by}" "${up[@]:0:shift_by}"
    done
  else
    bench_alone int4-serve "$OUT/int4_serve.csv" "${up[@]}"
    # INT4_WIDE=1: again with each server on 12 CPUs while measured (bench_alone's WIDE_CPUS)
    [ -n "${INT4_WIDE:-}" ] && WIDE_CPUS=0-11 BENCH_SEED=1 bench_alone int4-serve-wide "$OUT/int4_serve.csv" "${up[@]}"
  fi
  ;;
pdl-ab)
  # Issue 16.3: our PDL chain on against off (SQUEEZESERVE_PDL=auto / off), beside Machete, on one lease and
  # interleaved: ROUNDS rounds (default 4), each measuring every server alone at c = 1, 16 and 64 with the
  # round's own prompts, the servers' order rotated a round, the measured one on CPUs 0-11 while measured (no
  # server gains from a CPU set of its own). Two single runs at c=64 had the chain 1.3% and 4.2% slower, within
  # their leases' spread (NOTES.md, twenty-sixth session). MODE=mode0: synth's configuration (no
  # torch.compile, full graphs of decode steps); else vLLM's default (compiled, CUDA graphs to 512 tokens).
  # B_ENV / B_LABEL: the third server's setting and name (default SQUEEZESERVE_PDL=off, chain-off); CONC: the
  # concurrencies (default 1 16 64); REQS: requests a level (default 4 x concurrency; over 256 requests c=64's
  # TTFT p50 moved 232-383 ms between rounds of one server: REQS=1024 for it). E.g.
  # B_ENV=SQUEEZESERVE_GLUON_PREFILL_MAX_M=4096 B_LABEL=gluon4096 (several settings separated by spaces).
  convert_baseline  # (the tokenizer of the bundled model)
  python3 tests/gpu/synthetic_llama.py --tokenizer $MODELS/hf --out $MODELS/llama8b-w4a16 --w4a16
  synth_args "${MODE:-compiled}"
  start_server w4a16-vllm 0-3 8202 $MODELS/llama8b-w4a16 "${COMMON[@]}"
  start_server chain 4-7 8203 $MODELS/llama8b-w4a16 "${COMMON[@]}" --quantization squeezeserve
  B_ENV=${B_ENV:-SQUEEZESERVE_PDL=off} B_LABEL=${B_LABEL:-chain-off}
  start_b() {  # (B_ENV, one or more NAME=VALUE separated by spaces, for this server only)
    local setting; for setting in $B_ENV; do local "${setting%%=*}"; export "${setting?}"; done; start_server "$@"
  }
  start_b "$B_LABEL" 8-11 8204 $MODELS/llama8b-w4a16 "${COMMON[@]}" --quantization squeezeserve
  read -r -a up <<< "$(wait_servers "$(cap "${START_TIMEOUT:-400}")" w4a16-vllm chain "$B_LABEL")"
  note "serving: ${up[*]}"
  [ ${#up[@]} -gt 0 ] || exit 1
  for round in $(seq "${ROUNDS:-4}"); do
    shift_by=$(( (round - 1) % ${#up[@]} ))
    for label in "${up[@]:shift_by}" "${up[@]:0:shift_by}"; do
      pin "$label" 0-11
      timeout "$(cap 100)" taskset -c 12-15 python3 tests/benchmarks/bench_serving.py \
        --base-url "http://127.0.0.1:${PORT[$label]}" --model "$label" --run "${RUN:-pdl-ab}-r$round" \
        --label "$label" --vocab 49152 --concurrency ${CONC:-1 16 64} --prompt-tokens 256 --output-tokens 64 \
        --requests-per-level "${REQS:-0}" --seed "$round" --metrics-root "http://127.0.0.1:${PORT[$label]}" \
        --csv "$OUT/vllm_pdl_ab.csv" 2>&1 | tee -a "$SUMMARY"
      pin "$label" "${CPUS[$label]}"
    done
  done
  ;;
int8)
  # Issue 19.5 on the whole wikitext-2 test file: sample:int8-gptq (GPTQ per channel) and the same recipe
  # with round-to-nearest, calibrated on the whole calibration file, each validated against the fp16 baseline.
  stage_data
  convert_baseline
  for algo in rtn gptq; do
    python3 - "$algo" "$DATA" "$MODELS/int8-$algo.yaml" <<'PY'
import sys, yaml
from squeezeserve.service.compress.recipes import recipe_path
algo, data, out = sys.argv[1:]
recipe = yaml.safe_load(recipe_path("sample:int8-gptq").read_text())
recipe["stages"][0]["algorithm"] = algo
recipe["calibration"] = f"{data}/calibration.txt"
recipe["validate"].pop("max_tokens", None)
recipe["validate"].update(dataset=f"{data}/test.txt", dtype="float16")
open(out, "w").write(yaml.safe_dump(recipe, sort_keys=False))
PY
    timeout "$(cap 280)" $SQ pipeline "$MODELS/int8-$algo.yaml" --model $MODELS/hf --out "$MODELS/int8-$algo" \
      --device cuda > "$LOGS/pipeline-int8-$algo.log" 2>&1
    note "int8 $algo: pipeline exit $?; $(grep -E '^  (pass|FAIL) ' "$LOGS/pipeline-int8-$algo.log" | tr -s ' ')"
    cp "$MODELS/int8-$algo/report/report.md" "$OUT/int8-$algo-report.md" 2>/dev/null
    cp "$MODELS/int8-$algo/report/report.json" "$OUT/int8-$algo-report.json" 2>/dev/null
  done
  ;;
recipes)
  # Issue 19.4. Every run is `squeezeserve pipeline` on a recipe derived from sample:prune-distill-int4
  # (tests/gpu/recipes_table.py recipe): the whole wikitext-2 calibration file, validated on the whole test
  # file against the fp16 baseline. The issue's recipe (mlp-width 0.25 -> kd -> int4 GPTQ) first, then the
  # curve: each ratio with kd and with lm recovery at the same steps. Runs live in $MODELS/recipes and a
  # finished one is skipped, so the stage resumes across calls while the machine stays warm (and inside a
  # run, the pipeline resumes from its last finished stage). Once every run is done: vLLM serves the baseline,
  # the smallest checkpoint that passed its gates, the recipe's int4 and its fp16 stage before int4 (label
  # $RECIPE-fp16), side by
  # side; each is measured alone at c=1 and c=64 (TPOT, output throughput). The table goes to $OUT.
  stage_data
  convert_baseline
  RUNS=$MODELS/recipes
  RT="python3 tests/gpu/recipes_table.py"
  mkdir -p "$RUNS" "$LOGS/runs"
  # RECIPE names the run served as the recipe (with its fp16 stage before int4).
  RECIPE=${RECIPE:-mlp0.25-kd-int4}
  # The recipe: RECIPE_STEPS (1000) steps, scored on the whole test file. The curve: CURVE_STEPS for kd and
  # lm alike, scored on the first CURVE_TOKENS (a run here: ~3 steps/s, and ~1 min per model for the whole
  # file). RECIPE_PLAN (runs separated by '|', e.g. "0.5 kd|0.5 lm") narrows a call to some runs; an entry
  # may start with the structure ("layers 0.25 kd int4"; default mlp-width); RECIPE_LR sets the learning rate.
  IFS='|' read -r -a PLAN <<< "${RECIPE_PLAN:-0.25 kd int4|0.25 kd|0.25 lm|0.5 kd|0.5 lm|0.75 kd|0.75 lm}"
  pending=0
  for entry in "${PLAN[@]}"; do
    structure=mlp-width
    case "$entry" in mlp-width\ *|layers\ *|heads\ *) read -r structure entry <<< "$entry" ;; esac
    read -r ratio loss quant <<< "$entry"
    prefix=${structure%%-*}  # mlp, layers, heads
    name=$prefix$ratio-$loss${quant:+-$quant}
    if grep -qs '"validation"' "$RUNS/$name/model/squeeze.json"; then continue; fi
    # A run that cannot finish in this call is not started (RUN_S: seconds one run takes here).
    if [ $((BUDGET_S - SECONDS)) -lt "${RUN_S:-150}" ]; then
      note "$name: not started, $((BUDGET_S - SECONDS)) s left in this call"; pending=$((pending + 1)); continue
    fi
    if [ -n "$quant" ]; then knobs=(--steps "${RECIPE_STEPS:-1000}" --quantize)
    else knobs=(--steps "${CURVE_STEPS:-200}" --max-tokens "${CURVE_TOKENS:-65536}"); fi
    [ -n "${RECIPE_LR:-}" ] && knobs+=(--lr "$RECIPE_LR")
    $RT recipe --structure "$structure" --ratio "$ratio" --loss "$loss" "${knobs[@]}" \
      --calibration $DATA/calibration.txt --dataset $DATA/test.txt --out "$RUNS/$name.yaml"
    start=$SECONDS
    timeout "$(cap 480)" $SQ pipeline "$RUNS/$name.yaml" --model $MODELS/hf --out "$RUNS/$name" --device cuda \
      > "$LOGS/pipeline-$name.log" 2>&1
    code=$?
    note "$name: pipeline exit $code (0 pass, 1 gate failed, 124 out of time) after $((SECONDS - start)) s;" \
      "$(grep -E '^  (pass|FAIL) ' "$LOGS/pipeline-$name.log" | tr -s ' ' | tr '\n' ' ')"
    grep -qs '"validation"' "$RUNS/$name/model/squeeze.json" || pending=$((pending + 1))
  done
  for run in "$RUNS"/*/; do
    name=$(basename "$run"); mkdir -p "$LOGS/runs/$name"
    cp "$RUNS/$name.yaml" "$run/model/squeeze.json" "$run/report/report.md" "$LOGS/runs/$name/" 2>/dev/null
  done
  if [ "$pending" -gt 0 ]; then
    note "recipes: $pending run(s) left: run the stage again (serving waits for every run)"
  elif [ -f "$RUNS/serving.csv" ]; then
    note "recipes: every run and the serving measurement were done earlier"
  elif [ $((BUDGET_S - SECONDS)) -lt "${SERVE_S:-280}" ]; then
    note "recipes: every run is done; serving needs ${SERVE_S:-280} s, $((BUDGET_S - SECONDS)) s left: run the stage again"
  else
    declare -A SERVE=([baseline]=$MODELS/hf [$RECIPE]=$RUNS/$RECIPE/model
                      [$RECIPE-fp16]=$RUNS/$RECIPE/stages/02-distill)
    small=$($RT smallest "$RUNS") && SERVE[$(basename "$(dirname "$small")")]=$small
    note "smallest acceptable: ${small:-none passed its gates}"
    COMMON=(--dtype float16 --max-model-len 1024 --max-num-seqs 64 --gpu-memory-utilization 0.1
            --kv-cache-memory-bytes 2147483648)
    labels=(); i=0
    for label in "${!SERVE[@]}"; do
      start_server "$label" "$((3 * i))-$((3 * i + 2))" $((8601 + i)) "${SERVE[$label]}" "${COMMON[@]}" && labels+=("$label")
      i=$((i + 1))
    done
    read -r -a up <<< "$(wait_servers "$(cap "${START_TIMEOUT:-300}")" "${labels[@]}")"
    note "serving: ${up[*]}"
    for label in "${up[@]}"; do
      timeout "$(cap 90)" taskset -c 12-15 python3 tests/benchmarks/bench_serving.py \
        --base-url "http://127.0.0.1:${PORT[$label]}" --model "$label" --run recipes --label "$label" --vocab 49152 \
        --concurrency 1 64 --prompt-tokens 256 --output-tokens 128 --csv "$RUNS/serving.csv" 2>&1 | tee -a "$SUMMARY"
    done
  fi
  [ -f "$RUNS/serving.csv" ] && cp "$RUNS/serving.csv" "$OUT/recipes_serving.csv"
  $RT table "$RUNS" --serving "$RUNS/serving.csv" --device "$DEVICE" --csv "$OUT/recipes.csv" --md "$OUT/recipes.md" \
    | tee -a "$SUMMARY"
  [ "$pending" -eq 0 ] && [ -f "$RUNS/serving.csv" ] && note "recipes complete"
  ;;
tp)
  # Issue 18.1 on two GPUs: the bundled model, fp16 with our SiluAndMul/RMSNorm and int4 (RTN g32,
  # asymmetric) through our quantization method, at TP=1 and TP=2. No torch.compile (CUDA graphs only) to
  # keep four starts inside one call; a profiler window per server writes one trace per engine process.
  convert_baseline
  # SmolLM2's 9 heads / 3 KV groups do not divide by 2: serve its real weights cut to 6 heads / 2 groups.
  [ -f $MODELS/hf6/config.json ] || python3 tests/gpu/tp_model.py --model $MODELS/hf --out $MODELS/hf6 | tee -a "$SUMMARY"
  if [ ! -f $MODELS/hf6-int4/config.json ]; then
    timeout "$(cap 120)" $SQ compress --model $MODELS/hf6 --method int4 --algorithm rtn --out $MODELS/hf6-int4 \
      > "$LOGS/compress-int4-rtn.log" 2>&1; note "int4 RTN g32 of the 6-head cut: exit $?"
  fi
  TPC=(--dtype float16 --max-model-len 1024 --max-num-seqs 16 --gpu-memory-utilization 0.2
       --compilation-config '{"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}')
  prof() { echo "--profiler-config={\"profiler\": \"torch\", \"torch_profiler_dir\": \"$LOGS/prof-$1\", \"torch_profiler_with_stack\": false}"; }
  GPUS=0 start_server fp16-tp1 0-7 8301 $MODELS/hf6 "${TPC[@]}" "$(prof fp16-tp1)"
  GPUS=1 start_server int4-tp1 8-15 8302 $MODELS/hf6-int4 "${TPC[@]}" --quantization squeezeserve "$(prof int4-tp1)"
  read -r -a up <<< "$(wait_servers "$(cap 240)" fp16-tp1 int4-tp1)"
  for label in "${up[@]}"; do greedy_and_profile "$label"; done
  stop_server fp16-tp1; stop_server int4-tp1
  GPUS=0,1 start_server fp16-tp2 0-7 8303 $MODELS/hf6 "${TPC[@]}" --tensor-parallel-size 2 "$(prof fp16-tp2)"
  GPUS=0,1 start_server int4-tp2 8-15 8304 $MODELS/hf6-int4 "${TPC[@]}" --tensor-parallel-size 2 \
    --quantization squeezeserve "$(prof int4-tp2)"
  read -r -a up <<< "$(wait_servers "$(cap 300)" fp16-tp2 int4-tp2)"
  for label in "${up[@]}"; do greedy_and_profile "$label"; done
  stop_server fp16-tp2; stop_server int4-tp2
  for m in fp16 int4; do
    python3 - "$LOGS/greedy-$m-tp1.json" "$LOGS/greedy-$m-tp2.json" "$m" <<'PY' | tee -a "$SUMMARY"
import json, sys
try:
    a, b = (json.load(open(p)) for p in sys.argv[1:3])
except OSError as exc:
    print(f"{sys.argv[3]}: missing ({exc})"); sys.exit()
same = sum(x == y for x, y in zip(a, b))
print(f"{sys.argv[3]}: greedy TP=2 equals TP=1 on {same}/{len(a)} prompts")
for x, y in zip(a, b):
    if x != y:
        print(f"  tp1 {x!r}\n  tp2 {y!r}")
PY
  done
  for label in fp16-tp1 int4-tp1 fp16-tp2 int4-tp2; do
    echo "== $label" | tee -a "$SUMMARY"; count_kernels "$LOGS/prof-$label"
    grep -E "Error|error" "$LOGS/worker-$label.log" | grep -v "error_" | head -3 | tee -a "$SUMMARY"
  done
  ;;
tp8b)
  # Issue 18.1: the 8B-shaped W4A16 model through our method at TP=1 (GPU 0) and TP=2, one after the other.
  python3 tests/gpu/synthetic_llama.py --tokenizer $MODELS/hf --out $MODELS/llama8b-w4a16 --w4a16
  C8=(--dtype bfloat16 --load-format dummy --max-model-len 1024 --max-num-seqs 64 --gpu-memory-utilization 0.5
      --compilation-config '{"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}' --quantization squeezeserve)
  for tp in 1 2; do
    label=w4a16-ours-tp$tp
    GPUS=$([ $tp = 1 ] && echo 0 || echo 0,1) start_server $label 0-15 $((8400 + tp)) $MODELS/llama8b-w4a16 \
      "${C8[@]}" --tensor-parallel-size $tp
    read -r -a up <<< "$(wait_servers "$(cap 240)" $label)"
    [ ${#up[@]} = 1 ] && timeout "$(cap 150)" taskset -c 16-19 python3 tests/benchmarks/bench_serving.py \
      --base-url "http://127.0.0.1:$((8400 + tp))" --model $label --run tp --label $label --vocab 49152 \
      --concurrency 1 64 --prompt-tokens 256 --output-tokens 64 --csv "$OUT/vllm_tp.csv" 2>&1 | tee -a "$SUMMARY"
    stop_server $label
  done
  ;;
scale)
  # Issue 18.2/18.3: two 8B-shaped bf16 replicas (one per GPU, prefix caching on: vLLM's default) behind
  # gateways: one gateway with worker A alone, one with both. Throughput (non-streamed) at c=64/256 for
  # one vs two; shared-prefix routing (least_outstanding vs prefix_affinity, per-request header); then a
  # replica killed mid-run under load.
  python3 tests/gpu/synthetic_llama.py --tokenizer $MODELS/hf --out $MODELS/llama8b-bf16
  # SCALE_COMPILE=1: vLLM's default torch.compile + piecewise CUDA graphs (mixed prefill/decode steps run
  # graphed; slower to start); SCALE_PROMPT / SCALE_OUTPUT: the throughput workload; SCALE_PREFIX=0 skips
  # the routing comparison.
  C8=(--dtype bfloat16 --load-format dummy --max-model-len 2048 --max-num-seqs 256 --gpu-memory-utilization 0.85)
  [ "${SCALE_COMPILE:-0}" = 1 ] || C8+=(--compilation-config '{"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}')
  TW=(--prompt-tokens "${SCALE_PROMPT:-256}" --output-tokens "${SCALE_OUTPUT:-128}")
  NAME=llama8b GPUS=0 start_server replica-a 0-7 8501 $MODELS/llama8b-bf16 "${C8[@]}"
  NAME=llama8b GPUS=1 start_server replica-b 8-15 8502 $MODELS/llama8b-bf16 "${C8[@]}"
  GW_PORT=8110 start_gateway 16-19 8501
  GW_PORT=8120 start_gateway 20-23 8501 8502
  read -r -a up <<< "$(wait_servers "$(cap 300)" replica-a replica-b)"
  note "serving: ${up[*]}"; sleep 3
  BS=(taskset -c 24-31 python3 tests/benchmarks/bench_scale.py --model llama8b --csv "$OUT/scale.csv")
  timeout "$(cap 120)" "${BS[@]}" throughput --gateway http://127.0.0.1:8110 --label one-replica \
    --concurrency 64 256 "${TW[@]}" 2>&1 | tail -n 4 | tee -a "$SUMMARY"
  timeout "$(cap 120)" "${BS[@]}" throughput --gateway http://127.0.0.1:8120 --label two-replicas \
    --concurrency 64 256 "${TW[@]}" 2>&1 | tail -n 4 | tee -a "$SUMMARY"
  [ "${SCALE_PREFIX:-1}" = 1 ] && timeout "$(cap 150)" "${BS[@]}" prefix --gateway http://127.0.0.1:8120 --label two-replicas \
    --workers http://127.0.0.1:8501 http://127.0.0.1:8502 --concurrency 16 --output-tokens 16 \
    --prefix-words 800 2>&1 | tail -n 4 | tee -a "$SUMMARY"
  timeout "$(cap 120)" "${BS[@]}" throughput --gateway http://127.0.0.1:8120 --label kill-replica-b \
    --concurrency 64 --requests 512 "${TW[@]}" --kill-pid "${PID[replica-b]}" --kill-after 5 2>&1 | tail -n 4 | tee -a "$SUMMARY"
  grep -E "ejected|unreachable" "$LOGS/gateway-8120.log" | head -5 | tee -a "$SUMMARY"
  ;;
*) note "unknown stage $STAGE"; exit 2 ;;
esac
[ -f "$LOGS/probe.log" ] && sort -t' ' -k2,2 -k1,1 "$LOGS/probe.log" | head -40 | tee -a "$SUMMARY"
note "stage $STAGE done"
exit 0
