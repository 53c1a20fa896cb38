#!/usr/bin/env bash
# The GPU measurements still open, as whole device calls (each under the device's 10-minute
# limit: every step has its own timeout, so what finished comes back even if a later step runs
# long). Run `bash benchmarks/device_wheels.sh` here first, carry [".whl"], and on the device:
#
#   bash benchmarks/device_calls.sh inference   # one H200: prefill/scoring graphs, server, decode
#   bash benchmarks/device_calls.sh kernels     # one H200: the batch-1 step's kernel choices
#   bash benchmarks/device_calls.sh output      # one H200: the output projection in cuBLAS, twice
#   bash benchmarks/device_calls.sh serve       # one H200: the server at 1-64 streams; 64, py-spy
#   bash benchmarks/device_calls.sh switch      # one H200: the server under two GIL switch intervals
#   bash benchmarks/device_calls.sh gc          # one H200: the server with and without gc.freeze
#   bash benchmarks/device_calls.sh http        # one H200: HTTP in its own process or not; sampled
#   bash benchmarks/device_calls.sh sampled     # one H200: top-k draws; the server sampled, greedy
#   bash benchmarks/device_calls.sh decode-table  # one H200: issue 14's decode rows, 1B and 3B
#   bash benchmarks/device_calls.sh mslk        # one H200: int4 on MSLK's kernels (carry .whl-mslk)
#   bash benchmarks/device_calls.sh gemv        # one H200: decode on lmforge's Triton GEMV, 1B and 3B
#   bash benchmarks/device_calls.sh fused       # one H200: decode with the norms, SiLU·up, residuals in the GEMVs
#   bash benchmarks/device_calls.sh profile-fused  # one H200: the 1B bf16 step profiled, blocks fused or not
#   bash benchmarks/device_calls.sh xtile       # one H200: x as a tile or a vector in the GEMV (autotuner's picks)
#   bash benchmarks/device_calls.sh attention   # one H200: decode with RoPE, cache write and attention in one kernel
#   bash benchmarks/device_calls.sh search      # one H200: attention splits; the GEMV's tiles over a wide grid
#   bash benchmarks/device_calls.sh final       # one H200: the attention kernel checked on the GPU; decode 1B/3B
#   bash benchmarks/device_calls.sh verify      # one H200: as final, with the autotuner's picks and a 2,000-token prompt
#   bash benchmarks/device_calls.sh early       # one H200: kernels launched early (first weights loaded first) or not
#   bash benchmarks/device_calls.sh check       # one H200: the GEMV's and the attention kernel's tests, compiled
#   bash benchmarks/device_calls.sh preload     # one H200: 1 or 2 tiles preloaded, each with its own tiles; int4 on the GEMV
#   bash benchmarks/device_calls.sh dot         # one H200: one-row products on the tensor cores against the GEMV
#   bash benchmarks/device_calls.sh decode-rows # one H200: the 3B's bf16 and int8 rows; the 1B's again in a new process
#   bash benchmarks/device_calls.sh tiles       # one H200: the GEMV's tiles chosen inside the decode step (tile_search.py)
#   bash benchmarks/device_calls.sh step-tiles  # one H200: tiles searched in the step, 1B/3B bf16/int8, one table
#   bash benchmarks/device_calls.sh int8-tiles  # one H200: int8 tiles, biased or exact, searched again; GPU tests
#   bash benchmarks/device_calls.sh pinned      # one H200: decode rows with the pinned tiles; int8 exact; GPU tests
#   bash benchmarks/device_calls.sh int4        # one H200: GPU tests; int4 in packed fp16, on tinygemm, on the GEMV's bytes; 1B, 3B
#   bash benchmarks/device_calls.sh int4-products  # one H200: the int4 products one at a time beside bf16's; early-launch test
#   bash benchmarks/device_calls.sh int4-rows   # one H200: the int4 decode rows in fresh processes (1B also with int4 output)
#   bash benchmarks/device_calls.sh int4-tiles  # one H200: int4's tiles searched inside the decode step, 1B and 3B
#   bash benchmarks/device_calls.sh int4-step   # one H200: the 1B int4 step profiled beside bf16; int4's step tiles, 1B
#   bash benchmarks/device_calls.sh swiglu      # one H200: SiLU·up made by w13 or in w2, 1B/3B, tiles tuned; GPU tests; 1B int4 profiled
#   bash benchmarks/device_calls.sh swiglu-tiles  # one H200: the tiles of the products SiLU·up changed, searched in the step, 1B and 3B
#   bash benchmarks/device_calls.sh swiglu-rows # one H200: issue 14's decode rows with those tiles (carry the table as gemv_tiles.json)
#   bash benchmarks/device_calls.sh split       # one H200: rows split among programs (split-K) or not, 1B/3B; GPU tests
#   bash benchmarks/device_calls.sh step-added  # one H200: what each kernel adds to the 1B's bf16/int8/int4 step; int4 + int4 output; launch_floor.py
#   bash benchmarks/device_calls.sh ncu         # one H200: the 1B's block products (bf16/int8/int4) timed cold, then under Nsight Compute
#   bash benchmarks/device_calls.sh deep        # one H200: the 1B's int8 products searched among folded deep tiles in the step; rows
#   bash benchmarks/device_calls.sh deep-split  # one H200: the 1B's int8 wo and w2 among folded deep tiles split among programs; rows
#   bash benchmarks/device_calls.sh deep-next   # one H200: the 3B's int8 among deep tiles; the 1B's int8 a second pass; rows 1B/3B
#   bash benchmarks/device_calls.sh quantized-rows  # one H200: issue 14's int8/int4 rows as shipped, 1B and 3B
#   bash benchmarks/device_calls.sh greedy-graph    # one H200: greedy tokens chosen inside the graph: GPU test, A/B rows
#   bash benchmarks/device_calls.sh offset      # one H200: int8 kept as q + 128: GPU tests, A/B rows 1B/3B
#   bash benchmarks/device_calls.sh offset-tiles  # one H200: the rest of offset's GPU tests; the 1B's int8 tiles searched again; rows
#   bash benchmarks/device_calls.sh offset-final  # one H200: the torchao conversion tests on the GPU; quantized-rows
#   bash benchmarks/device_calls.sh serve-now   # one H200: the server at 1-64 streams beside Generator's batch-1 rate, today's engine
#   bash benchmarks/device_calls.sh final-profile    # one H200: the 1B's bf16/int8/int4 step kernel by kernel; a dropped Generator's memory
#   bash benchmarks/device_calls.sh final-profile-3b # one H200: the 3B's bf16/int4 step kernel by kernel
#   bash benchmarks/device_calls.sh release-fix      # one H200: the engine's recordings on one stream: GPU tests, memory left, 1B rows
#   bash benchmarks/device_calls.sh tp          # two H200s: tensor-parallel inference (8B)
#   bash benchmarks/device_calls.sh fsdp2       # two H200s: issue 13's FSDP2 rows, 1B and 3B as shipped (tied), 1 vs 2 GPUs
#   bash benchmarks/device_calls.sh fsdp2-post  # two H200s: TP 2 on the 3B; 3B SFT-LoRA and DPO-LoRA on 2 GPUs against the plan
#   bash benchmarks/device_calls.sh train       # one H200: 1B training beside torchtitan
#   bash benchmarks/device_calls.sh train-3b    # one H200: 3B training beside torchtitan
#   bash benchmarks/device_calls.sh train-autotune  # one H200: 1B with max-autotune beside torchtitan
#   bash benchmarks/device_calls.sh train-kernels  # one H200: the loss's row kernel and the AdamW update alone, tiles
#   bash benchmarks/device_calls.sh train-final # one H200: 1B, 1B float8 and 3B beside torchtitan, before and after
#   bash benchmarks/device_calls.sh train-fused # one H200: 1B, the fused loss and the Triton AdamW, beside torchtitan
#   bash benchmarks/device_calls.sh train-bf16p # one H200: bf16 weights with fp32 masters against autocast, beside torchtitan
#   bash benchmarks/device_calls.sh train-fused-3b  # one H200: the same for the 3B, profiled; the 1B profiled
#
# Logs and JSON go to $OUT (at most 8 files come back: each call writes fewer); the last lines
# printed are each step's table.
set -uo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
inference | kernels | output | serve | switch | gc | http | sampled | decode-table | mslk | gemv | fused | profile-fused | xtile | attention | search | final | verify | early | check | preload | dot | decode-rows | tiles | step-tiles | int8-tiles | pinned | int4 | int4-products | int4-rows | fsdp2 | fsdp2-post | int4-tiles | int4-step | swiglu | swiglu-tiles | swiglu-rows | split | step-added | ncu | deep | deep-split | deep-next | quantized-rows | greedy-graph | offset | offset-tiles | offset-final | serve-now | final-profile | final-profile-3b | release-fix | tp | train | train-3b | train-autotune | train-fused | train-fused-3b | train-kernels | train-final | train-bf16p | train-full-post | train-dpo-full) ;;
*)
  echo "usage: bash benchmarks/device_calls.sh inference|kernels|output|serve|switch|gc|http|sampled|decode-table|mslk|gemv|fused|profile-fused|xtile|attention|search|final|verify|early|check|preload|dot|decode-rows|tiles|step-tiles|int8-tiles|pinned|int4|int4-products|int4-rows|fsdp2|fsdp2-post|int4-tiles|int4-step|swiglu|swiglu-tiles|swiglu-rows|split|step-added|ncu|deep|deep-split|deep-next|quantized-rows|greedy-graph|offset|offset-tiles|offset-final|serve-now|final-profile|final-profile-3b|release-fix|tp|train|train-3b|train-autotune|train-fused|train-fused-3b|train-kernels|train-final|train-bf16p|train-full-post|train-dpo-full" >&2
  exit 2
  ;;
esac
wheels=.whl
[ "$1" = mslk ] && wheels=.whl-mslk  # `bash benchmarks/device_wheels.sh mslk`
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site "$wheels"/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/device-calls}
mkdir -p "$OUT" /tmp/traces

step() {  # step SECONDS NAME COMMAND...: run with a timeout, log to $OUT/NAME.log
  local seconds=$1 name=$2
  shift 2
  echo "== $name (at most ${seconds}s): $*"
  timeout "$seconds" "$@" >"$OUT/$name.log" 2>&1
  echo "   exit $? after ${SECONDS}s of the call"
}

# the GEMV's and the attention kernel's tests, compiled, launched early, autotuned
KERNEL_TESTS="fusions_equal or decode_attention_equals or early_launch"
kernel_tests() {  # kernel_tests SECONDS EXPR: tests/test_kernels.py -k EXPR on the GPU, as `check`
  step "$1" check env TRITON_INTERPRET=0 python3 -m pytest -q -p no:cacheprovider \
    tests/test_kernels.py -k "$2"
}

# deep_search SECONDS NAME PRESET TOKENS [ARGS...]: the preset's int8 products searched inside the
# step among the folded deep tiles (tile_search.py --folded), merged into $OUT/gemv_tiles.json
deep_search() {
  local seconds=$1 name=$2 preset=$3 tokens=$4
  shift 4
  TRITON_CACHE_DIR=/tmp/triton-$name step "$seconds" "$name" python3 benchmarks/tile_search.py \
    --preset "llama3.2-$preset" --schemes int8-wo --passes 1 --tokens "$tokens" --folded \
    --out "$OUT/$name" --table "$OUT/gemv_tiles.json" "$@"
}
# deep_call SEARCH_SECONDS ROWS_SECONDS [ARGS...]: the 1B's deep search (ARGS to tile_search.py)
# into a copy of the table, then its rows with that table
deep_call() {
  cp lmforge/generate/gemv_tiles.json "$OUT/gemv_tiles.json"
  export LMFORGE_GEMV_TILES="$OUT/gemv_tiles.json"
  deep_search "$1" search 1b 64 "${@:3}"
  int8_rows "$2" rows 1b
  grep -h "pass 1\|^{" "$OUT/search.log" | cut -c1-220
  grep -h '^{' "$OUT/rows.log" | cut -c1-250
  grep -h -c Traceback "$OUT"/search.log "$OUT"/rows.log || true
}
# ab_rows SECONDS PRESET VARIANT SCHEMES...: the preset's decode rows as shipped and as VARIANT,
# one process (its own Triton cache), into rows-PRESET.log and $OUT/PRESET
ab_rows() {
  local seconds=$1 preset=$2 variant=$3
  shift 3
  TRITON_CACHE_DIR=/tmp/triton-rows-$preset step "$seconds" "rows-$preset" python3 \
    benchmarks/decode.py --presets "llama3.2-$preset" --variants lmforge "$variant" \
    --schemes "$@" --new-tokens 128 --repeats 2 --out "$OUT/$preset"
}
# int8_rows SECONDS NAME PRESET: the preset's bf16 and int8 decode rows, fresh process and cache
int8_rows() {
  TRITON_CACHE_DIR=/tmp/triton-$2 step "$1" "$2" python3 benchmarks/decode.py \
    --presets "llama3.2-$3" --variants lmforge --schemes bf16 int8-wo --new-tokens 128 \
    --repeats 2 --out "$OUT/$2"
}

case "${1:-}" in
inference)
  # graphed prefills and scoring (time to the first token, lm-eval-like scoring eager vs
  # graphs), the server at 1 to 64 streams, and batch-1 decode in bf16 and int4
  step 110 first-token python3 benchmarks/first_token.py --preset llama3.2-1b --out /tmp/traces
  step 90 score python3 benchmarks/score_speed.py --preset llama3.2-1b
  step 200 serve python3 benchmarks/serve_load.py --preset llama3.2-1b --device cuda \
    --max-concurrency 64 --concurrency 1 8 32 64 --max-tokens 128 --max-seq-len 4096 \
    --out "$OUT"
  step 170 decode python3 benchmarks/decode.py --presets llama3.2-1b --variants lmforge \
    --schemes bf16 int4-wo --new-tokens 128 --repeats 2 --out /tmp/traces
  head -n 12 "$OUT/first-token.log"
  tail -n 2 "$OUT/score.log"
  tail -n 8 "$OUT/serve.log"
  tail -n 6 "$OUT/decode.log"
  ;;
kernels)
  # the 1B bf16 batch-1 step under inductor choices, each a fresh compile, and int4 in gemlite
  step 440 profile python3 benchmarks/decode_profile.py --preset llama3.2-1b --schemes bf16 \
    --variants default realize-0 realize-8 wide-tuning --out /tmp/traces
  step 130 gemlite python3 benchmarks/decode.py --presets llama3.2-1b --variants lmforge \
    --schemes int4-gemlite --new-tokens 128 --repeats 2 --out /tmp/traces
  grep -A 10 "^== " "$OUT/profile.log" | grep -v "^--$" | cut -c1-220
  tail -n 4 "$OUT/gemlite.log"
  ;;
output)
  # scoring graphs against eager in bf16 and float32; then the batch-1 step with the output
  # projection as inductor's tuned reduction or as one cuBLAS call, each compiled twice in a
  # fresh inductor cache (the tuned reductions differ from compile to compile)
  step 120 score python3 benchmarks/score_speed.py --preset llama3.2-1b
  for round in 1 2; do
    for variant in default cublas-output; do
      step 110 "$variant-$round" env TORCHINDUCTOR_CACHE_DIR="/tmp/inductor-$variant-$round" \
        python3 benchmarks/decode_profile.py --preset llama3.2-1b --schemes bf16 \
        --variants "$variant" --out /tmp/traces
    done
  done
  grep -h "largest log-probability" "$OUT/score.log"
  for log in "$OUT"/default-*.log "$OUT"/cublas-output-*.log; do
    grep -h -A 4 "^== " "$log" | cut -c1-200
  done
  ;;
serve)
  # the server at 1-64 streams as in `inference`; then a second server at 64 streams twice
  # (the spread within a call), the first level under py-spy
  step 200 serve python3 benchmarks/serve_load.py --preset llama3.2-1b --device cuda \
    --max-concurrency 64 --concurrency 1 8 32 64 --max-tokens 128 --max-seq-len 4096 \
    --out "$OUT"
  step 200 serve-64 python3 benchmarks/serve_load.py --preset llama3.2-1b --device cuda \
    --max-concurrency 64 --concurrency 64 64 --requests 768 --max-tokens 128 \
    --max-seq-len 4096 --profile-server 3 --out "$OUT/profiled"
  tail -n 7 "$OUT/serve.log"
  tail -n 4 "$OUT/serve-64.log"
  python3 benchmarks/py_spy_summary.py "$OUT/profiled/serve_py_spy.txt" --top 30 | cut -c1-160
  ;;
final-profile)
  # issue 14's rows that miss (1B int8 and int4), kernel by kernel as the step runs today
  # (decode_profile.py: what each kernel adds), beside bf16; then whether a dropped Generator's
  # GPU memory comes back (engine_release.py)
  step 260 profile python3 benchmarks/decode_profile.py --preset llama3.2-1b \
    --schemes bf16 int8-wo int4-wo --out /tmp/traces
  step 150 release python3 benchmarks/engine_release.py --preset llama3.2-1b --scheme int8-wo
  grep -A 40 "^== " "$OUT/profile.log" | grep -v "^  longest\|->" | cut -c1-160
  cat "$OUT/release.log" | cut -c1-200 | head -60
  grep -h -c Traceback "$OUT"/*.log || true
  ;;
final-profile-3b)
  # the same profile for the 3B (its int4 row misses), beside its bf16; engine_release.py again
  step 330 profile python3 benchmarks/decode_profile.py --preset llama3.2-3b \
    --schemes bf16 int4-wo --out /tmp/traces
  step 150 release python3 benchmarks/engine_release.py --preset llama3.2-1b --scheme int8-wo
  grep -A 40 "^== " "$OUT/profile.log" | grep -v "^  longest\|->" | cut -c1-160
  grep -v Warning "$OUT/release.log" | cut -c1-240 | head -60
  grep -h -c Traceback "$OUT"/*.log || true
  ;;
release-fix)
  # the engine's recordings on one stream: the GPU tests of tests/test_generate.py (a dropped
  # engine leaves at most its stream's cuBLAS workspace), engine_release.py again, and the 1B's
  # rows with their peak memory, bf16 then int8 then int4 in one process
  step 150 tests env TRITON_INTERPRET=0 python3 -m pytest -q -p no:cacheprovider \
    tests/test_generate.py -k "dropped_engine or greedy_tokens_chosen"
  step 120 release python3 benchmarks/engine_release.py --preset llama3.2-1b --scheme int8-wo
  step 200 rows python3 benchmarks/decode.py --presets llama3.2-1b --variants lmforge \
    --schemes bf16 int8-wo int4-wo --new-tokens 128 --repeats 2 --out "$OUT/rows"
  tail -n 3 "$OUT/tests.log"
  grep -v Warning "$OUT/release.log" | cut -c1-240 | head -40
  grep -h '^{' "$OUT/rows.log" | cut -c1-250
  grep -h -c Traceback "$OUT"/*.log || true
  ;;
serve-now)
  # issue 14's server rows again (last measured in session 11, when Generator decoded the 1B at
  # ~880 tok/s; the GEMV sessions since made it ~1,280): the server at 1-64 streams, then
  # Generator's batch-1 bf16 rate in the same call for the one-stream ratio
  step 220 serve python3 benchmarks/serve_load.py --preset llama3.2-1b --device cuda \
    --max-concurrency 64 --concurrency 1 8 32 64 --max-tokens 128 --max-seq-len 4096 \
    --out "$OUT"
  step 120 decode python3 benchmarks/decode.py --presets llama3.2-1b --variants lmforge \
    --schemes bf16 --new-tokens 128 --repeats 2 --out "$OUT/decode"
  tail -n 7 "$OUT/serve.log"
  grep -h '^{' "$OUT/decode.log" | cut -c1-250
  grep -h -c Traceback "$OUT"/*.log || true
  ;;
switch)
  # the server's GIL switch interval: Python's default 5 ms against 0.5 ms, alternating, at
  # 32 and 64 streams (the engine thread waits for the GIL after each step's synchronize)
  for run in 5-a 0.5-a 5-b 0.5-b; do
    step 100 "switch-$run" python3 benchmarks/serve_load.py --preset llama3.2-1b --device cuda \
      --max-concurrency 64 --concurrency 32 64 --max-tokens 128 --max-seq-len 4096 \
      --switch-interval-ms "${run%-*}" --out "$OUT/$run"
  done
  for run in 5-a 0.5-a 5-b 0.5-b; do echo "-- $run ms"; tail -n 2 "$OUT/switch-$run.log"; done
  ;;
gc)
  # the server with its start-up objects frozen out of the garbage collector's sight (as it
  # ships) and without, at 1-64 streams; the table's last column is GC seconds per level
  step 150 gc-frozen python3 benchmarks/serve_load.py --preset llama3.2-1b --device cuda \
    --max-concurrency 64 --concurrency 1 8 32 64 --max-tokens 128 --max-seq-len 4096 \
    --out "$OUT/frozen"
  step 110 gc-unfrozen python3 benchmarks/serve_load.py --preset llama3.2-1b --device cuda \
    --max-concurrency 64 --concurrency 1 8 32 64 --max-tokens 128 --max-seq-len 4096 \
    --no-gc-freeze --out "$OUT/unfrozen"
  for run in frozen unfrozen; do echo "-- $run"; tail -n 4 "$OUT/gc-$run.log"; done
  ;;
http)
  # the server as it ships (HTTP in a process of its own) against HTTP and the engine in one
  # process, greedy at 1-64 streams; sampled requests (temperature 1, top-k 50: unseeded rows
  # draw together) after the draws alone; a second start at 64 streams under py-spy
  step 40 sample-speed python3 benchmarks/sample_speed.py --rows 64
  step 170 two python3 benchmarks/serve_load.py --preset llama3.2-1b --device cuda \
    --max-concurrency 64 --concurrency 1 8 32 64 --max-tokens 128 --max-seq-len 4096 \
    --out "$OUT/two"
  step 110 one python3 benchmarks/serve_load.py --preset llama3.2-1b --device cuda \
    --max-concurrency 64 --concurrency 1 8 32 64 --max-tokens 128 --max-seq-len 4096 \
    --no-http-process --out "$OUT/one"
  step 110 sampled python3 benchmarks/serve_load.py --preset llama3.2-1b --device cuda \
    --max-concurrency 64 --concurrency 1 8 32 64 --max-tokens 128 --max-seq-len 4096 \
    --temperature 1 --top-k 50 --out "$OUT/sampled"
  step 110 two-64 python3 benchmarks/serve_load.py --preset llama3.2-1b --device cuda \
    --max-concurrency 64 --concurrency 64 64 --requests 768 --max-tokens 128 \
    --max-seq-len 4096 --profile-server 3 --out "$OUT/profiled"
  cat "$OUT/sample-speed.log"
  for run in two one sampled two-64; do echo "-- $run"; tail -n 4 "$OUT/$run.log"; done
  python3 benchmarks/py_spy_summary.py "$OUT/profiled/serve_py_spy.txt" --top 16 | cut -c1-160
  ;;
sampled)
  # the sampler's draws alone (top-p: a sort of the vocabulary; top-k: the largest k only); a
  # write of one element of a device tensor while the GPU is busy, by index and by fill_ (does
  # either wait for the GPU?); the server greedy, then sampled with top-k 50 (and top-p 0.95),
  # then 64 streams under py-spy
  step 40 sample-speed python3 benchmarks/sample_speed.py --rows 64
  step 20 scalar-write python3 -c '
import time, torch
t, a = torch.zeros(64, dtype=torch.long, device="cuda"), torch.randn(8192, 8192, device="cuda")
for name, write in (("t[5] = 7", lambda: t.__setitem__(5, 7)), ("t[5:6].fill_(7)", lambda: t[5:6].fill_(7))):
    times = []
    for _ in range(21):
        torch.cuda.synchronize(); a @ a; start = time.perf_counter(); write()
        times.append(time.perf_counter() - start)
    print(f"{name}: {1e6 * sorted(times)[10]:.1f} us on the host, behind a queued matmul")'
  step 170 greedy python3 benchmarks/serve_load.py --preset llama3.2-1b --device cuda \
    --max-concurrency 64 --concurrency 1 8 32 64 --max-tokens 128 --max-seq-len 4096 \
    --out "$OUT/greedy"
  step 100 top-k python3 benchmarks/serve_load.py --preset llama3.2-1b --device cuda \
    --max-concurrency 64 --concurrency 1 8 32 64 --max-tokens 128 --max-seq-len 4096 \
    --temperature 1 --top-k 50 --out "$OUT/top-k"
  step 100 top-k-p python3 benchmarks/serve_load.py --preset llama3.2-1b --device cuda \
    --max-concurrency 64 --concurrency 8 64 --max-tokens 128 --max-seq-len 4096 \
    --temperature 0.8 --top-k 50 --top-p 0.95 --out "$OUT/top-k-p"
  step 100 greedy-64 python3 benchmarks/serve_load.py --preset llama3.2-1b --device cuda \
    --max-concurrency 64 --concurrency 64 64 --requests 768 --max-tokens 128 \
    --max-seq-len 4096 --profile-server 3 --out "$OUT/profiled"
  cat "$OUT/sample-speed.log" "$OUT/scalar-write.log"
  for run in greedy top-k top-k-p greedy-64; do echo "-- $run"; tail -n 4 "$OUT/$run.log"; done
  python3 benchmarks/py_spy_summary.py "$OUT/profiled/serve_py_spy.txt" --top 16 | cut -c1-160
  ;;
decode-table)
  # issue 14's decode rows again with the code as it ships, one call: 1B bf16 / int8 / int4
  # beside transformers' static-cache generate, 3B bf16 / int4 (batch 1, 128 new tokens)
  step 300 decode-1b python3 benchmarks/decode.py --presets llama3.2-1b \
    --variants lmforge hf-static --schemes bf16 int8-wo int4-wo --new-tokens 128 --repeats 2 \
    --out "$OUT/1b"
  step 250 decode-3b python3 benchmarks/decode.py --presets llama3.2-3b --variants lmforge \
    --schemes bf16 int4-wo --new-tokens 128 --repeats 2 --out "$OUT/3b"
  tail -n 8 "$OUT/decode-1b.log"
  tail -n 5 "$OUT/decode-3b.log"
  ;;
gemv)
  # batch-1 decode with lmforge's Triton GEMV (plain weights; int8), 1B and 3B; the step as
  # inductor compiles it (--variants lmforge-inductor) and the products one at a time
  # (benchmarks/gemv.py --shapes 1b --rows 1 64) were measured in earlier calls
  # (docs/benchmarks.md)
  export TRITON_PRINT_AUTOTUNING=1
  step 150 decode-1b python3 benchmarks/decode.py --presets llama3.2-1b --variants lmforge \
    --schemes bf16 int8-wo int4-wo --new-tokens 128 --repeats 2 --out "$OUT/1b"
  step 120 decode-3b python3 benchmarks/decode.py --presets llama3.2-3b --variants lmforge \
    --schemes bf16 int4-wo --new-tokens 128 --repeats 2 --out "$OUT/3b"
  grep '^{' "$OUT/decode-1b.log" | cut -c1-400
  grep '^{' "$OUT/decode-3b.log" | cut -c1-400
  grep -h -c Traceback "$OUT"/*.log || true
  ;;
fused)
  # batch-1 decode with each block as four GEMVs around attention (norms, SiLU·up and residual
  # adds inside them) against the GEMVs alone, bf16 / int8 / int4 (int4 also as torchao's
  # tinygemm); then the products one at a time (int8 and int4 values converted without the
  # integer-to-float unit)
  step 290 decode-1b python3 benchmarks/decode.py --presets llama3.2-1b \
    --variants lmforge lmforge-unfused-blocks lmforge-torchao --schemes bf16 int8-wo int4-wo \
    --new-tokens 128 --repeats 2 --out "$OUT/1b"
  step 170 decode-3b python3 benchmarks/decode.py --presets llama3.2-3b --variants lmforge \
    --schemes bf16 int4-wo --new-tokens 128 --repeats 2 --out "$OUT/3b"
  step 90 gemv python3 benchmarks/gemv.py --shapes 1b --rows 1 --out "$OUT"
  grep '^{' "$OUT/decode-1b.log" | cut -c1-330
  grep '^{' "$OUT/decode-3b.log" | cut -c1-330
  grep '^|' "$OUT/gemv.log"
  grep -h -c Traceback "$OUT"/*.log || true
  ;;
profile-fused)
  # where the 1B bf16 step's time goes with fused blocks and without (torch.profiler over 20
  # steps of the recorded graph, the largest kernels)
  step 280 profile python3 benchmarks/decode_profile.py --preset llama3.2-1b --schemes bf16 \
    --variants default unfused-blocks --out /tmp/traces
  grep -A 16 "^== " "$OUT/profile.log" | cut -c1-240
  grep -h -c Traceback "$OUT"/*.log || true
  ;;
xtile)
  # the products one at a time with the autotuner's picks printed (x loaded as a vector or as a
  # tile of the weight's shape), then batch-1 decode of the 1B and 3B in bf16 and int8
  export TRITON_PRINT_AUTOTUNING=1
  step 150 gemv python3 benchmarks/gemv.py --shapes 1b 3b --rows 1 --out "$OUT"
  step 150 decode-1b python3 benchmarks/decode.py --presets llama3.2-1b --variants lmforge \
    --schemes bf16 int8-wo --new-tokens 128 --repeats 2 --out "$OUT/1b"
  step 150 decode-3b python3 benchmarks/decode.py --presets llama3.2-3b --variants lmforge \
    --schemes bf16 int8-wo --new-tokens 128 --repeats 2 --out "$OUT/3b"
  grep '^|' "$OUT/gemv.log"
  grep -h -B2 "best config" "$OUT"/gemv.log | cut -c1-200
  grep '^{' "$OUT/decode-1b.log" | cut -c1-330
  grep '^{' "$OUT/decode-3b.log" | cut -c1-330
  grep -h -c Traceback "$OUT"/*.log || true
  ;;
attention)
  # batch-1 decode with each fused block's attention in one kernel (RoPE, the cache write and
  # attention; blocks unfused as before beside it), the 1B step profiled, then the 1B's fused
  # products one at a time (taller tiles tried where a product takes a norm or SiLU·up)
  step 150 decode-1b python3 benchmarks/decode.py --presets llama3.2-1b \
    --variants lmforge lmforge-unfused-blocks --schemes bf16 int8-wo --new-tokens 128 \
    --repeats 2 --out "$OUT/1b"
  step 150 decode-3b python3 benchmarks/decode.py --presets llama3.2-3b --variants lmforge \
    --schemes bf16 int8-wo --new-tokens 128 --repeats 2 --out "$OUT/3b"
  step 120 profile python3 benchmarks/decode_profile.py --preset llama3.2-1b --schemes bf16 \
    --variants default --out /tmp/traces
  TRITON_PRINT_AUTOTUNING=1 step 100 gemv python3 benchmarks/gemv.py --shapes 1b --rows 1 \
    --out "$OUT"
  grep '^{' "$OUT/decode-1b.log" | cut -c1-330
  grep '^{' "$OUT/decode-3b.log" | cut -c1-330
  grep -A 14 "^== " "$OUT/profile.log" | cut -c1-200
  grep '^|' "$OUT/gemv.log"
  grep -h -B1 "best config" "$OUT"/gemv.log | grep -v "^--" | cut -c1-120
  grep -h -c Traceback "$OUT"/*.log || true
  ;;
search)
  # every 1B/3B product at one row, bf16 and int8, plain and fused, over a wide grid of tiles:
  # the best of the grid against the best of the tiles the autotuner tries
  # (first: the 1B bf16 step with the attention kernel's slots split 256 / 64 / 32 a program)
  step 150 profile python3 benchmarks/decode_profile.py --preset llama3.2-1b --schemes bf16 \
    --variants default attention-split-64 attention-split-32 --out /tmp/traces
  step 330 search python3 benchmarks/gemv_search.py --deadline 290 --out "$OUT"
  grep -A 6 "^== " "$OUT/profile.log" | cut -c1-200
  grep '^|' "$OUT/search.log"
  grep -h -c Traceback "$OUT"/*.log || true
  ;;
final)
  # the attention kernel compiled for the GPU against SDPA (its splits merged by the last
  # program of each group, run twice: the counters must be zero again), then batch-1 decode of
  # the 1B and 3B in bf16 and int8, and the 1B bf16 step profiled
  kernel_tests 120 decode_attention_equals
  step 150 decode-1b python3 benchmarks/decode.py --presets llama3.2-1b --variants lmforge \
    --schemes bf16 int8-wo --new-tokens 128 --repeats 2 --out "$OUT/1b"
  step 150 decode-3b python3 benchmarks/decode.py --presets llama3.2-3b --variants lmforge \
    --schemes bf16 int8-wo --new-tokens 128 --repeats 2 --out "$OUT/3b"
  step 100 profile python3 benchmarks/decode_profile.py --preset llama3.2-1b --schemes bf16 \
    --variants default --out /tmp/traces
  tail -n 4 "$OUT/check.log"
  grep '^{' "$OUT/decode-1b.log" | cut -c1-330
  grep '^{' "$OUT/decode-3b.log" | cut -c1-330
  grep -A 8 "^== " "$OUT/profile.log" | cut -c1-200
  grep -h -c Traceback "$OUT"/*.log || true
  ;;
verify)
  # the code as session 14 left it (measured in parts only): the attention kernel on the GPU
  # against SDPA; decode of the 1B and 3B in bf16 and int8 with the autotuner's picks printed;
  # the 1B in bf16 after a 2,000-token prompt (9 splits and the merge kernel) beside cuDNN's
  # attention; the 1B bf16 step profiled
  kernel_tests 120 decode_attention_equals
  TRITON_PRINT_AUTOTUNING=1 step 150 decode-1b python3 benchmarks/decode.py \
    --presets llama3.2-1b --variants lmforge --schemes bf16 int8-wo --new-tokens 128 \
    --repeats 2 --out "$OUT/1b"
  step 150 decode-3b python3 benchmarks/decode.py --presets llama3.2-3b --variants lmforge \
    --schemes bf16 int8-wo --new-tokens 128 --repeats 2 --out "$OUT/3b"
  step 120 long python3 benchmarks/decode.py --presets llama3.2-1b \
    --variants lmforge lmforge-unfused-blocks --schemes bf16 --prompt-len 2000 \
    --new-tokens 128 --repeats 2 --out "$OUT/long"
  step 80 profile python3 benchmarks/decode_profile.py --preset llama3.2-1b --schemes bf16 \
    --variants default --out /tmp/traces
  tail -n 2 "$OUT/check.log"
  grep '^{' "$OUT/decode-1b.log" "$OUT/decode-3b.log" "$OUT/long.log" | cut -c1-330
  grep -h -B2 "best config" "$OUT/decode-1b.log" | grep -v "^--\|^finished" | cut -c1-120
  grep -A 8 "^== " "$OUT/profile.log" | cut -c1-200
  grep -h -c Traceback "$OUT"/*.log || true
  ;;
mslk)
  # torchao's preshuffled int4 layout on MSLK's Hopper kernels (bf16 or float8 activations,
  # int4 weights) beside tinygemm and bf16, the 1B at batch 1; carry [".whl-mslk"]
  step 20 mslk python3 -c 'import mslk, torch; print("mslk", mslk.__version__, "torch", torch.__version__)'
  step 330 decode python3 benchmarks/decode.py --presets llama3.2-1b --variants lmforge \
    --schemes int4-preshuffled fp8-int4 bf16 int4-wo --new-tokens 128 --repeats 2 --out "$OUT"
  cat "$OUT/mslk.log"
  grep -h "Error" "$OUT/decode.log" | head -n 6
  tail -n 7 "$OUT/decode.log"
  ;;
tp)
  # 8B (random weights, bf16): decode tokens/s and eval seconds on one GPU and on two, with
  # the planner's figure beside each measured peak
  step 580 tp python3 benchmarks/tp_inference.py --rows eval-tp2 eval-tp1 generate-tp1 \
    generate-tp2 --work /tmp/tp-work --out "$OUT"
  tail -n 14 "$OUT/tp.log"
  ;;
early)
  # programmatic dependent launch (early_launch.py) and the int8 weights' conversion in PTX: the
  # GPU check of the GEMV (fused, quantized; compiled and launched early, two tiles preloaded);
  # decode of the 1B (bf16 and int8) and the 3B: early with two weight tiles loaded before the
  # wait (the engine), with one, and not early. Variants in one process share the autotuner's
  # tiles, so their greedy tokens must agree (a race would show as `same_tokens_as_first` < 128)
  kernel_tests 60 fusions_equal
  step 200 decode-1b python3 benchmarks/decode.py --presets llama3.2-1b \
    --variants lmforge lmforge-preload-1 lmforge-no-early --schemes bf16 int8-wo \
    --new-tokens 128 --repeats 2 --out "$OUT/1b"
  step 150 decode-3b python3 benchmarks/decode.py --presets llama3.2-3b \
    --variants lmforge lmforge-no-early --schemes bf16 int8-wo --new-tokens 128 --repeats 2 \
    --out "$OUT/3b"
  tail -n 3 "$OUT/check.log"
  grep -h '^{' "$OUT/decode-1b.log" "$OUT/decode-3b.log" | cut -c1-330
  grep -h -c Traceback "$OUT"/*.log || true
  ;;
preload)
  # the GEMV launched early with one or two weight tiles loaded before its wait, each tuned
  # under its own variant (a Triton cache directory each: the tiles are kept on disk), twice
  # in turn; then int4 on tinygemm (as shipped) beside int4 converted for the GEMV
  for round in 1 2; do
    for variant in lmforge lmforge-preload-1; do
      TRITON_CACHE_DIR=/tmp/triton-$variant step 110 "$variant-$round" python3 \
        benchmarks/decode.py --presets llama3.2-1b --variants "$variant" --schemes bf16 \
        int8-wo --new-tokens 128 --repeats 2 --out "$OUT/$variant-$round"
    done
  done
  step 120 int4 python3 benchmarks/decode.py --presets llama3.2-1b \
    --variants lmforge lmforge-int4-bytes --schemes bf16 int4-wo --new-tokens 128 --repeats 2 \
    --out "$OUT/int4"
  grep -h '^{' "$OUT"/*.log | cut -c1-330
  grep -h -c Traceback "$OUT"/*.log || true
  ;;
dot)
  # benchmarks/gemv_dot.py: the 1B's products (bf16 and int8, plain and fused) on the tensor
  # cores against kernels.gemv, then the 3B's widest
  step 330 dot-1b python3 benchmarks/gemv_dot.py
  step 200 dot-3b python3 benchmarks/gemv_dot.py --products "3b w13" "3b w2"
  cat "$OUT/dot-1b.log" "$OUT/dot-3b.log" | grep "^|" | cut -c1-200
  grep -h -c Traceback "$OUT"/*.log || true
  ;;
decode-rows)
  # issue 14's decode rows with the code as it ships: the 3B bf16 and int8; the 1B's again in
  # a process of its own (the tiles kept on disk by an earlier call on this machine, if any)
  step 200 decode-3b python3 benchmarks/decode.py --presets llama3.2-3b --variants lmforge \
    --schemes bf16 int8-wo --new-tokens 128 --repeats 2 --out "$OUT/3b"
  step 150 decode-1b python3 benchmarks/decode.py --presets llama3.2-1b --variants lmforge \
    --schemes bf16 int8-wo --new-tokens 128 --repeats 2 --out "$OUT/1b"
  grep -h '^{' "$OUT"/decode-*.log | cut -c1-300
  grep -h -c Traceback "$OUT"/*.log || true
  ;;
tiles)
  # benchmarks/tile_search.py in a fresh Triton cache: the autotuner's picks, then each
  # product's tiles tried inside the step (coordinate descent); the 1B bf16 and int8, the 3B int8
  TRITON_CACHE_DIR=/tmp/triton-tiles step 330 tiles-1b python3 benchmarks/tile_search.py \
    --preset llama3.2-1b --schemes bf16 int8-wo --out "$OUT/1b"
  TRITON_CACHE_DIR=/tmp/triton-tiles step 240 tiles-3b python3 benchmarks/tile_search.py \
    --preset llama3.2-3b --schemes int8-wo --passes 1 --out "$OUT/3b"
  grep -h "pass \|^{" "$OUT"/tiles-*.log | cut -c1-200
  grep -h -c Traceback "$OUT"/*.log || true
  ;;
step-tiles)
  # the GEMV's tiles searched inside the step from the autotuner's picks (fresh Triton cache,
  # no pinned tiles), merged into one table: the 1B and 3B in bf16, int8 and int8 with the
  # output projection quantized
  export LMFORGE_GEMV_TILES=none TRITON_CACHE_DIR=/tmp/triton-search
  step 260 search-1b python3 benchmarks/tile_search.py --preset llama3.2-1b --passes 1 \
    --schemes bf16 int8-wo int8-wo-output --out "$OUT/1b" --table "$OUT/gemv_tiles.json"
  step 320 search-3b python3 benchmarks/tile_search.py --preset llama3.2-3b --passes 1 \
    --schemes bf16 int8-wo int8-wo-output --out "$OUT/3b" --table "$OUT/gemv_tiles.json"
  grep -h "^{" "$OUT"/search-*.log | cut -c1-150
  grep -h -c Traceback "$OUT"/*.log || true
  ;;
int8-tiles)
  # the int8 products searched again in the step, biased or exact now tuned like a tile, from
  # the committed table's picks; the step's tok/s after the search; then the kernels' GPU tests
  export TRITON_CACHE_DIR=/tmp/triton-int8
  cp lmforge/generate/gemv_tiles.json "$OUT/gemv_tiles.json"
  step 150 int8-1b python3 benchmarks/tile_search.py --preset llama3.2-1b --passes 1 \
    --schemes int8-wo int8-wo-output --out "$OUT/1b" --table "$OUT/gemv_tiles.json"
  step 200 int8-3b python3 benchmarks/tile_search.py --preset llama3.2-3b --passes 1 \
    --schemes int8-wo int8-wo-output --out "$OUT/3b" --table "$OUT/gemv_tiles.json"
  kernel_tests 120 "$KERNEL_TESTS"
  grep -h "^{" "$OUT"/int8-*.log | cut -c1-150
  tail -n 2 "$OUT/check.log"
  grep -h -c Traceback "$OUT"/int8-*.log || true
  ;;
pinned)
  # issue 14's decode rows with the pinned tiles as committed (lmforge/generate/gemv_tiles.json),
  # a fresh Triton cache; int8 biased (as shipped) and exact with the same tiles; then the
  # kernels' GPU tests
  export TRITON_CACHE_DIR=/tmp/triton-pinned
  step 200 pinned-1b python3 benchmarks/decode.py --presets llama3.2-1b --variants lmforge \
    lmforge-int8-exact --schemes bf16 int8-wo int8-wo-output --new-tokens 128 --repeats 2 \
    --out "$OUT/1b"
  step 230 pinned-3b python3 benchmarks/decode.py --presets llama3.2-3b --variants lmforge \
    lmforge-int8-exact --schemes bf16 int8-wo int8-wo-output --new-tokens 128 --repeats 2 \
    --out "$OUT/3b"
  kernel_tests 150 "$KERNEL_TESTS"
  grep -h '^{' "$OUT"/pinned-*.log | cut -c1-200
  tail -n 3 "$OUT/check.log"
  grep -h -c Traceback "$OUT"/pinned-*.log || true
  ;;
int4)
  # the kernels' GPU tests (int4 in packed fp16 among them); then int4 (group 128) decoding in
  # packed fp16 (`kernels._gemv_int4`, as shipped), on tinygemm (lmforge-torchao) and through
  # `_gemv`'s bytes (lmforge-int4-bytes), 1B and 3B, each preset in a fresh process and Triton
  # cache, bf16 first for the ratio; the int4 autotuner's picks printed
  export TRITON_PRINT_AUTOTUNING=1
  TRITON_CACHE_DIR=/tmp/triton-int4-1b step 200 int4-1b python3 benchmarks/decode.py \
    --presets llama3.2-1b --variants lmforge lmforge-torchao lmforge-int4-bytes \
    --schemes bf16 int4-wo --new-tokens 128 --repeats 2 --out "$OUT/1b"
  TRITON_CACHE_DIR=/tmp/triton-int4-3b step 200 int4-3b python3 benchmarks/decode.py \
    --presets llama3.2-3b --variants lmforge lmforge-torchao --schemes bf16 int4-wo \
    --new-tokens 128 --repeats 2 --out "$OUT/3b"
  kernel_tests 130 "$KERNEL_TESTS or large_activations"
  grep -h "_gemv_int4\|best config" "$OUT"/int4-*.log | sort | uniq -c | head -20
  tail -n 3 "$OUT/check.log"
  grep -h '^{' "$OUT"/int4-*.log | cut -c1-250
  grep -h -c Traceback "$OUT"/int4-*.log || true
  ;;
int4-rows)
  # issue 14's int4 rows again, each preset in a fresh process and Triton cache: int4 in
  # packed fp16 as shipped, bf16 first for the ratio; the 1B also with its output projection int4
  TRITON_CACHE_DIR=/tmp/triton-rows-1b step 150 rows-1b python3 benchmarks/decode.py \
    --presets llama3.2-1b --variants lmforge --schemes bf16 int4-wo int4-wo-output \
    --new-tokens 128 --repeats 2 --out "$OUT/1b"
  TRITON_CACHE_DIR=/tmp/triton-rows-3b step 150 rows-3b python3 benchmarks/decode.py \
    --presets llama3.2-3b --variants lmforge --schemes bf16 int4-wo --new-tokens 128 \
    --repeats 2 --out "$OUT/3b"
  grep -h '^{' "$OUT"/rows-*.log | cut -c1-250
  grep -h -c Traceback "$OUT"/rows-*.log || true
  ;;
int4-tiles)
  # int4's tiles (packed fp16) chosen inside the decode step (tile_search.py), 1B and 3B, from
  # a fresh autotune; the step's picks merged into $OUT/gemv_tiles.json (to commit if faster)
  cp lmforge/generate/gemv_tiles.json "$OUT/gemv_tiles.json"
  TRITON_CACHE_DIR=/tmp/triton-tiles4-1b step 250 tiles4-1b python3 benchmarks/tile_search.py \
    --preset llama3.2-1b --schemes int4-wo --passes 1 --out "$OUT/1b" --table "$OUT/gemv_tiles.json"
  TRITON_CACHE_DIR=/tmp/triton-tiles4-3b step 300 tiles4-3b python3 benchmarks/tile_search.py \
    --preset llama3.2-3b --schemes int4-wo --passes 1 --out "$OUT/3b" --table "$OUT/gemv_tiles.json"
  grep -h '^{' "$OUT"/tiles4-*.log | cut -c1-200
  grep -h -c Traceback "$OUT"/tiles4-*.log || true
  ;;
int4-step)
  # where the 1B's int4 step spends its time beside bf16's (torch.profiler over the recorded
  # graph); then int4-tiles' 1B half. (Run on 2026-12-02 with a step for session 20's
  # `kernels.INT4_AHEAD`, each int4 tile's loads a tile ahead: 1,326 against 1,348 tok/s, removed.)
  step 170 profile python3 benchmarks/decode_profile.py --preset llama3.2-1b \
    --schemes bf16 int4-wo --out /tmp/traces
  cp lmforge/generate/gemv_tiles.json "$OUT/gemv_tiles.json"
  TRITON_CACHE_DIR=/tmp/triton-tiles4-1b step 240 tiles4-1b python3 benchmarks/tile_search.py \
    --preset llama3.2-1b --schemes int4-wo --passes 1 --out "$OUT/1b" --table "$OUT/gemv_tiles.json"
  grep -A 24 "^== " "$OUT/profile.log" | cut -c1-240
  grep -h '^{' "$OUT"/tiles4-*.log | cut -c1-250
  grep -h -c Traceback "$OUT"/*.log || true
  ;;
swiglu)
  # SiLU·up made once after w13's products (as shipped, kernels.SWIGLU_IN_W13) against made by
  # each of w2's programs (lmforge-swiglu-in-w2), both with the autotuner's tiles (the table
  # pins only the old keys), 1B and 3B, each in a fresh process and Triton cache; the GPU
  # tests of the fusions; what each kernel of the 1B's int4 step adds to it
  export LMFORGE_GEMV_TILES=none
  TRITON_CACHE_DIR=/tmp/triton-sw-1b step 150 swiglu-1b python3 benchmarks/decode.py \
    --presets llama3.2-1b --variants lmforge lmforge-swiglu-in-w2 \
    --schemes bf16 int8-wo int4-wo --new-tokens 128 --repeats 2 --out "$OUT/1b"
  TRITON_CACHE_DIR=/tmp/triton-sw-3b step 150 swiglu-3b python3 benchmarks/decode.py \
    --presets llama3.2-3b --variants lmforge lmforge-swiglu-in-w2 --schemes bf16 int4-wo \
    --new-tokens 128 --repeats 2 --out "$OUT/3b"
  kernel_tests 90 "fusions_equal and swiglu or large_activations"
  step 80 profile python3 benchmarks/decode_profile.py --preset llama3.2-1b --schemes int4-wo \
    --out /tmp/traces
  grep -A 40 "^== " "$OUT/profile.log" | cut -c1-200
  grep -h '^{' "$OUT"/swiglu-*.log | cut -c1-250
  tail -n 3 "$OUT/check.log"
  grep -h -c Traceback "$OUT"/swiglu-*.log || true
  ;;
swiglu-tiles)
  # the tiles of the products the table does not pin (w13 with SiLU·up, w2 without it), searched
  # inside the step from the autotuner's picks, the rest pinned as committed; 1B and 3B in bf16,
  # int8 and int4; the picks merged into $OUT/gemv_tiles.json (to commit)
  cp lmforge/generate/gemv_tiles.json "$OUT/gemv_tiles.json"
  export LMFORGE_GEMV_TILES="$OUT/gemv_tiles.json"
  for preset in 1b 3b; do
    TRITON_CACHE_DIR=/tmp/triton-swt-$preset step 270 "search-$preset" python3 \
      benchmarks/tile_search.py --preset "llama3.2-$preset" --schemes bf16 int8-wo int4-wo \
      --passes 1 --tokens 64 --unpinned --out "$OUT/$preset" --table "$OUT/gemv_tiles.json"
  done
  grep -h '^{' "$OUT"/search-*.log | cut -c1-200
  grep -h -c Traceback "$OUT"/search-*.log || true
  ;;
swiglu-rows)
  # issue 14's decode rows with the committed tiles, each preset in a fresh process and Triton
  # cache: 1B bf16 / int8 / int4 / int4 with its output projection, 3B bf16 / int8 / int4
  TRITON_CACHE_DIR=/tmp/triton-rows-1b step 200 rows-1b python3 benchmarks/decode.py \
    --presets llama3.2-1b --variants lmforge --schemes bf16 int8-wo int4-wo int4-wo-output \
    --new-tokens 128 --repeats 2 --out "$OUT/1b"
  TRITON_CACHE_DIR=/tmp/triton-rows-3b step 200 rows-3b python3 benchmarks/decode.py \
    --presets llama3.2-3b --variants lmforge --schemes bf16 int8-wo int4-wo \
    --new-tokens 128 --repeats 2 --out "$OUT/3b"
  grep -h '^{' "$OUT"/rows-*.log | cut -c1-250
  grep -h -c Traceback "$OUT"/rows-*.log || true
  ;;
split)
  # products without a norm or SiLU·up (wo, w2, the output projection) with their rows shared
  # among 1, 2 or 4 programs, the count tuned at the pinned tile (as shipped, kernels.SPLIT_K)
  # against never (lmforge-no-split), 1B and 3B, bf16 / int8 / int4, each preset in a fresh
  # process and Triton cache; then the GPU tests of the fusions (split among them)
  export TRITON_PRINT_AUTOTUNING=1
  TRITON_CACHE_DIR=/tmp/triton-split-1b step 130 split-1b python3 benchmarks/decode.py \
    --presets llama3.2-1b --variants lmforge lmforge-no-split --schemes bf16 int8-wo int4-wo \
    --new-tokens 128 --repeats 2 --out "$OUT/1b"
  TRITON_CACHE_DIR=/tmp/triton-split-3b step 160 split-3b python3 benchmarks/decode.py \
    --presets llama3.2-3b --variants lmforge lmforge-no-split --schemes bf16 int8-wo int4-wo \
    --new-tokens 128 --repeats 2 --out "$OUT/3b"
  kernel_tests 60 "fusions_equal and (split or swiglu)"
  grep -h "best config" "$OUT"/split-*.log | grep -o "SPLITS: [0-9]" | sort | uniq -c
  grep -h '^{' "$OUT"/split-*.log | cut -c1-250
  tail -n 3 "$OUT/check.log"
  grep -h -c Traceback "$OUT"/split-*.log || true
  ;;
step-added)
  # where the 1B's quantized steps stand against bf16's, kernel by kernel (what each adds to the
  # step: decode_profile.py), as shipped; then the 1B's int4 row with its output projection int4
  step 200 profile python3 benchmarks/decode_profile.py --preset llama3.2-1b \
    --schemes bf16 int8-wo int4-wo --out /tmp/traces
  TRITON_CACHE_DIR=/tmp/triton-output step 110 output-1b python3 benchmarks/decode.py \
    --presets llama3.2-1b --variants lmforge --schemes bf16 int4-wo-output --new-tokens 128 \
    --repeats 2 --out "$OUT/1b"
  step 150 floor python3 benchmarks/launch_floor.py --out "$OUT"
  grep -A 40 "^== " "$OUT/profile.log" | grep -v "^  longest\|->" | cut -c1-160
  grep -h '^{' "$OUT/floor.log"
  grep -h '^{' "$OUT"/output-*.log | cut -c1-250
  grep -h -c Traceback "$OUT"/*.log || true
  ;;
deep)
  # the 1B's int8 products searched inside the step among the folded deep tiles (kernels.FOLD,
  # _ROW_DEEP: 4-16 rows a thread, a sum a row), from the pinned tiles; then the 1B's bf16 and
  # int8 rows with the picks merged into a copy of the table, in a fresh process and cache
  deep_call 270 110
  ;;
deep-split)
  # as deep, for the products with a residual add (wo, w2), whose deep tiles may now also share
  # each row among 2 or 4 programs (few rows a program leave few programs otherwise); then the
  # 1B's bf16 and int8 rows with the picks, in a fresh process and cache
  deep_call 160 55 --only residual
  ;;
deep-next)
  # prepared in session 22, not run: the 3B's int8 products searched among the folded deep
  # tiles (split where they may be), then a second pass over all four of the 1B's (the picks
  # interact), the picks merged into one table; then issue 14's int8 rows with it, fresh
  # processes and caches
  cp lmforge/generate/gemv_tiles.json "$OUT/gemv_tiles.json"
  export LMFORGE_GEMV_TILES="$OUT/gemv_tiles.json"
  deep_search 200 search-3b 3b 48
  deep_search 200 search-1b 1b 64
  int8_rows 90 rows-1b 1b
  int8_rows 90 rows-3b 3b
  grep -h "pass 1\|^{" "$OUT"/search-*.log | cut -c1-220
  grep -h '^{' "$OUT"/rows-*.log | cut -c1-250
  grep -h -c Traceback "$OUT"/*.log || true
  ;;
offset-final)
  # the torchao conversion tests, now run where the kernels do, then quantized-rows (below)
  kernel_tests 90 "torchao_linears"
  tail -n 2 "$OUT/check.log"
  ;&
quantized-rows)
  # issue 14's quantized rows as shipped (session 23), each preset in a fresh process and Triton
  # cache, bf16 first for the ratio: int8 and int4, and each with its output projection
  # quantized too (the 1B); the 3B's bf16, int8 and int4
  TRITON_CACHE_DIR=/tmp/triton-rows-1b step 260 rows-1b python3 benchmarks/decode.py \
    --presets llama3.2-1b --variants lmforge --schemes bf16 int8-wo int4-wo int8-wo-output \
    int4-wo-output --new-tokens 128 --repeats 2 --out "$OUT/1b"
  TRITON_CACHE_DIR=/tmp/triton-rows-3b step 200 rows-3b python3 benchmarks/decode.py \
    --presets llama3.2-3b --variants lmforge --schemes bf16 int8-wo int4-wo --new-tokens 128 \
    --repeats 2 --out "$OUT/3b"
  grep -h '^{' "$OUT"/rows-*.log | cut -c1-250
  grep -h -c Traceback "$OUT"/rows-*.log || true
  ;;
greedy-graph)
  # session 23: greedy steps choose their tokens inside the step's CUDA graph (engine.
  # GREEDY_IN_GRAPH): the engine's GPU test of it, then the decode rows beside the host's argmax
  # (variant lmforge-host-argmax) in the same process, 1B bf16/int8/int4 and 3B bf16/int8
  step 120 check env TRITON_INTERPRET=0 python3 -m pytest -q -p no:cacheprovider \
    tests/test_generate.py -k greedy_tokens_chosen
  ab_rows 150 1b lmforge-host-argmax bf16 int8-wo int4-wo
  ab_rows 150 3b lmforge-host-argmax bf16 int8-wo
  tail -n 3 "$OUT/check.log"
  grep -h '^{' "$OUT"/rows-*.log | cut -c1-260
  grep -h -c Traceback "$OUT"/*.log || true
  ;;
offset)
  # session 24: int8 weights kept as uint8 q + 128 (kernels.INT8_OFFSET: the xor that makes the
  # bytes the byte permutes read done once, at conversion): the int8 kernels' GPU tests, then
  # the 1B's and 3B's bf16 and int8 rows beside int8 as torchao stores it (variant
  # lmforge-int8-signed), one process a preset, the pinned tiles
  kernel_tests 200 "(fusions_equal and not 16 and not 4 and not signed and not vector) or \
(dequantized_product and int8) or torchao_linears"
  ab_rows 150 1b lmforge-int8-signed bf16 int8-wo
  ab_rows 170 3b lmforge-int8-signed bf16 int8-wo
  tail -n 3 "$OUT/check.log"
  grep -h '^{' "$OUT"/rows-*.log | cut -c1-260
  grep -h -c Traceback "$OUT"/*.log || true
  ;;
offset-tiles)
  # the int8 GPU tests `offset` left unrun (its 200 s ran out after 15 of 23, all passed), then
  # the 1B's int8 products searched again among the folded deep tiles from the pinned ones (the
  # products now spend fewer instructions a weight: biased or exact may trade places), and the
  # 1B's rows with the picks
  kernel_tests 150 "(fusions_equal and split and not 16 and not 4 and not signed and not \
vector) or (dequantized_product and int8) or torchao_linears"
  deep_call 270 110
  tail -n 3 "$OUT/check.log"
  ;;
ncu)
  # the 1B's block products as the fused block launches them, timed with the weights out of L2,
  # then their hardware counters (Nsight Compute: memory throughput, occupancy, issue, stalls)
  step 120 times python3 benchmarks/ncu_products.py --shape 1b
  ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu | head -n 1)
  step 400 ncu "$ncu" --clock-control none --kernel-name regex:_gemv --section SpeedOfLight \
    --section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats \
    --section MemoryWorkloadAnalysis python3 benchmarks/ncu_products.py --shape 1b --untimed \
    --launches 1
  cat "$OUT/times.log"
  grep -E "^  _gemv|Duration|DRAM Throughput|Registers Per|Achieved Occupancy|Theoretical Occ|Issue Slots Busy|Warp Cycles Per Issued|Block Limit Reg|No Eligible|Executed Ipc A|Waves Per|Grid Size|Block Size" "$OUT/ncu.log" | cut -c1-110
  ;;
fsdp2)
  # issue 13's scaling rows through the real CLI (benchmarks/multi_gpu.py): the 1B and 3B as
  # shipped (tied embeddings) on one GPU and on two under FSDP2 (target >= 1.9x), the 1B also
  # with bf16 reduce-scatters (parallel.reduce_dtype); the 1B's two-GPU step profiled
  step 560 fsdp2 python3 benchmarks/multi_gpu.py --rows 1b-1 1b-2 1b-2+bf16r 3b-1 3b-2 \
    --steps 12 --warmup 4 --profile 1b-2 --out "$OUT"
  tail -n 8 "$OUT/fsdp2.log"
  grep -h -c Traceback "$OUT/fsdp2.log" || true
  ;;
fsdp2-post)
  # TP 2 on the 3B (tokens/s, memory), then 3B SFT with LoRA and DPO with LoRA on two GPUs,
  # each against the planner's prediction (within 15% asked)
  step 560 post python3 benchmarks/multi_gpu.py --rows 3b-tp2 3b-2-sft-lora 3b-2-dpo-lora \
    --steps 10 --warmup 3 --out "$OUT"
  tail -n 6 "$OUT/post.log"
  grep -h -c Traceback "$OUT/post.log" || true
  ;;
int4-products)
  # the 1B's and 3B's products one at a time (one row, in a CUDA graph): bf16 in the GEMV
  # (alone and fused), int4 on tinygemm and in packed fp16; then the early-launch test that
  # the int4 call's test step left unfinished
  step 200 gemv python3 benchmarks/gemv.py --rows 1 --shapes 1b 3b --kernels "bf16 lmforge" \
    int4 --out "$OUT"
  kernel_tests 150 "early_launch"
  grep -h '^|' "$OUT/gemv.log"
  tail -n 3 "$OUT/check.log"
  ;;
check)
  # the kernels' tests on the GPU, compiled (TRITON_INTERPRET=0), launched early, autotuned
  kernel_tests 240 "$KERNEL_TESTS"
  tail -n 3 "$OUT/check.log"
  ;;
train)
  # one GPU, lmforge beside torchtitan 0.2.2 in the same call (target: >= 1.05x)
  step 210 titan env CASES=1B-c,1B-c-fp8 torchrun --nproc_per_node 1 .whl/titan_baseline.py
  step 200 ours-1b python3 benchmarks/train_throughput.py --shapes 1b:8x2048 \
    --variants ours-compile ours-float8 --out /tmp/traces
  tail -n 8 "$OUT/titan.log"
  grep -h '^{' "$OUT/ours-1b.log"
  ;;
train-autotune)
  # the 1B step with inductor's max-autotune (GEMMs among cuBLAS and Triton templates) beside
  # the shipped compile and torchtitan, one GPU (target: >= 1.05x torchtitan)
  step 150 titan env CASES=1B-c torchrun --nproc_per_node 1 .whl/titan_baseline.py
  step 400 ours-1b python3 benchmarks/train_throughput.py --shapes 1b:8x2048 \
    --variants ours-compile ours-compile-autotune --out /tmp/traces
  tail -n 8 "$OUT/titan.log"
  grep -h '^{' "$OUT/ours-1b.log"
  ;;
train-kernels)
  step 60 train-kernels env TRITON_INTERPRET=0 python3 -m pytest -q -p no:cacheprovider \
    tests/test_train_kernels.py
  step 120 output-loss python3 benchmarks/output_loss.py
  step 100 adamw-1b python3 benchmarks/adamw_update.py --preset llama3.2-1b
  step 100 adamw-3b python3 benchmarks/adamw_update.py --preset llama3.2-3b
  tail -n 3 "$OUT/train-kernels.log"
  cat "$OUT/output-loss.log" "$OUT/adamw-1b.log" "$OUT/adamw-3b.log"
  ;;
train-bf16p)
  # issue 13's one-GPU rows: bf16 weights with fp32 masters in the optimizer (as shipped, -bf16p)
  # and fp32 weights under autocast, beside torchtitan 0.2.2; then the real CLI on one GPU
  # (tokens/s, peak memory, the planner's prediction) and the kernels' GPU tests
  step 190 titan env CASES=1B-c,1B-c-fp8,3B-c torchrun --nproc_per_node 1 .whl/titan_baseline.py
  step 170 ours-1b python3 benchmarks/train_throughput.py --shapes 1b:8x2048 --variants \
    ours-compile-bf16p ours-float8-bf16p ours-compile --out /tmp/traces
  step 100 ours-3b python3 benchmarks/train_throughput.py --shapes 3b:4x2048 --variants \
    ours-compile-bf16p --out /tmp/traces
  step 60 train-kernels env TRITON_INTERPRET=0 python3 -m pytest -q -p no:cacheprovider \
    tests/test_train_kernels.py
  step 200 cli python3 benchmarks/multi_gpu.py --rows 1b-1 3b-1 --steps 12 --warmup 4 \
    --out "$OUT"
  tail -n 3 "$OUT/train-kernels.log"
  grep -h "^{'engine'" "$OUT/titan.log"
  grep -h '^{' "$OUT/ours-1b.log" "$OUT/ours-3b.log"
  tail -n 6 "$OUT/cli.log"
  ;;
train-full-post)
  # full SFT and DPO (a frozen fp32 copy as the reference, under autocast) on one GPU through the
  # CLI, with the bf16 weights and fp32 masters they take there: tokens/s, peak, the plan
  step 400 cli-post python3 benchmarks/multi_gpu.py --rows 1b-1-sft-full 1b-1-dpo-full \
    --steps 10 --warmup 3 --out "$OUT"
  tail -n 4 "$OUT/cli-post.log"
  ;;
train-dpo-full)
  # full DPO on one GPU through the CLI, its frozen reference in bf16 beside the bf16 weights
  step 300 cli-dpo python3 benchmarks/multi_gpu.py --rows 1b-1-dpo-full --steps 10 --warmup 3 \
    --out "$OUT"
  tail -n 3 "$OUT/cli-dpo.log"
  ;;
train-final)
  # issue 13's one-GPU rows: lmforge as it ships and as it was (the logits apart, PyTorch's
  # AdamW) beside torchtitan 0.2.2, one call (target: >= 1.05x on 1B, 3B and 1B float8)
  step 190 titan env CASES=1B-c,1B-c-fp8,3B-c torchrun --nproc_per_node 1 .whl/titan_baseline.py
  step 160 ours-1b python3 benchmarks/train_throughput.py --shapes 1b:8x2048 --variants \
    ours-compile ours-float8 ours-compile-logits-torchadam --out /tmp/traces
  step 100 ours-3b python3 benchmarks/train_throughput.py --shapes 3b:4x2048 --variants \
    ours-compile --out /tmp/traces
  step 60 train-kernels env TRITON_INTERPRET=0 python3 -m pytest -q -p no:cacheprovider \
    tests/test_train_kernels.py
  tail -n 3 "$OUT/train-kernels.log"
  grep -h "^{'engine'" "$OUT/titan.log"
  grep -h '^{' "$OUT/ours-1b.log" "$OUT/ours-3b.log"
  ;;
train-fused)
  # the training kernels' tests compiled on the GPU; then one GPU, lmforge with and without
  # the fused output loss and the Triton AdamW, beside torchtitan 0.2.2 (target: >= 1.05x)
  step 60 train-kernels env TRITON_INTERPRET=0 python3 -m pytest -q -p no:cacheprovider \
    tests/test_train_kernels.py
  step 50 output-loss python3 benchmarks/output_loss.py
  step 190 titan env CASES=1B-c,1B-c-fp8 torchrun --nproc_per_node 1 .whl/titan_baseline.py
  step 270 ours-1b python3 benchmarks/train_throughput.py --shapes 1b:8x2048 --variants \
    ours-compile ours-compile-logits-torchadam ours-compile-logits ours-compile-torchadam \
    ours-float8 --out /tmp/traces
  tail -n 3 "$OUT/train-kernels.log"
  cat "$OUT/output-loss.log"
  tail -n 8 "$OUT/titan.log"
  grep -h '^{' "$OUT/ours-1b.log"
  ;;
train-fused-3b)
  step 130 titan env CASES=3B-c torchrun --nproc_per_node 1 .whl/titan_baseline.py
  step 260 ours-3b python3 benchmarks/train_throughput.py --shapes 3b:4x2048 --variants \
    ours-compile ours-compile-logits-torchadam --profile --out /tmp/traces
  step 150 ours-1b python3 benchmarks/train_throughput.py --shapes 1b:8x2048 --variants \
    ours-compile --profile --out /tmp/traces
  tail -n 8 "$OUT/titan.log"
  grep -h '^{' "$OUT/ours-3b.log" "$OUT/ours-1b.log"
  ;;
train-3b)
  step 130 titan env CASES=3B-c torchrun --nproc_per_node 1 .whl/titan_baseline.py
  step 150 ours-3b python3 benchmarks/train_throughput.py --shapes 3b:4x2048 \
    --variants ours-compile --out /tmp/traces
  tail -n 8 "$OUT/titan.log"
  grep -h '^{' "$OUT/ours-3b.log"
  ;;
esac
