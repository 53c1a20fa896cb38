#!/usr/bin/env bash
# One device call for each table of docs/benchmarks.md, each under the device's 10-minute limit
# (every step has its own timeout, so what finished comes back even if a later step runs long).
# Run `bash benchmarks/device_wheels.sh` here first, carry [".whl"], and on the device:
#
#   bash benchmarks/device_calls.sh CASE     # CASE: one of the cases below, one a table
#
# Each case's first comment names the machine (one H200 unless it says two) and what it measures.
# Logs and JSON go to $OUT; the last lines printed are each step's table.
set -uo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
train | lora | int4-mma | cli | cli-post | memory | fsdp2 | fsdp2-post | tp | decode | decode-hf | serve | products | fbgemm | moe | moe-quantized | moe-train | moe-lora | fp8 | quantized-serve | quantized-8b | tiles | check | grpo | grpo-ab | grpo-2gpu | moe-2gpu | moe-serve | structured-serve | prefix-serve | adapters-serve | gpt-oss | eval-share | trl) ;;
*)
  echo "usage: bash benchmarks/device_calls.sh train|lora|int4-mma|cli|cli-post|memory|fsdp2|fsdp2-post|tp|decode|decode-hf|serve|products|fbgemm|moe|moe-quantized|moe-train|moe-lora|fp8|quantized-serve|quantized-8b|tiles|check|grpo|grpo-ab|grpo-2gpu|moe-2gpu|moe-serve|structured-serve|prefix-serve|adapters-serve|gpt-oss|eval-share|trl" >&2
  exit 2
  ;;
esac
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/device-calls}
mkdir -p "$OUT"

step() {  # step SECONDS NAME COMMAND...: run with a timeout, log to $OUT/NAME.log
  local seconds=$1 name=$2
  shift 2
  echo "== $name (at most ${seconds}s): $*"
  timeout "$seconds" "$@" >"$OUT/$name.log" 2>&1
  echo "   exit $? after ${SECONDS}s of the call"
}
gpu_tests() {  # gpu_tests SECONDS NAME FILE [PYTEST ARGS...]: tests compiled for the GPU
  local seconds=$1 name=$2
  shift 2
  step "$seconds" "$name" env TRITON_INTERPRET=0 python3 -m pytest -q -p no:cacheprovider "$@"
}
# decode_rows SECONDS PRESET SCHEMES...: a preset's decode rows, a fresh process and Triton cache
decode_rows() {
  local seconds=$1 preset=$2
  shift 2
  TRITON_CACHE_DIR=/tmp/triton-$preset step "$seconds" "decode-$preset" python3 \
    benchmarks/decode.py --presets "llama3.2-$preset" --variants lmforge --schemes "$@" \
    --new-tokens 128 --repeats 2 --out "$OUT/$preset"
}

case "$1" in
train)
  # one GPU, lmforge beside torchtitan 0.2.2 + compile in the same call (target: >= 1.05x)
  step 190 titan env CASES=1B-c,1B-c-fp8,3B-c torchrun --nproc_per_node 1 .whl/titan_baseline.py
  step 170 ours-1b python3 benchmarks/train_throughput.py --shapes 1b:8x2048 --variants \
    ours-compile-bf16p ours-float8-bf16p ours-compile
  step 100 ours-3b python3 benchmarks/train_throughput.py --shapes 3b:4x2048 --variants \
    ours-compile-bf16p
  grep -h "^{'engine'" "$OUT/titan.log"
  grep -h '^{' "$OUT/ours-1b.log" "$OUT/ours-3b.log"
  ;;
lora)
  # 1B LoRA and QLoRA (rank 16, the blocks' seven linears) training steps
  step 300 lora python3 benchmarks/train_throughput.py --shapes 1b:8x2048 --variants \
    ours-lora-compile ours-qlora-compile --steps 6 --warmup 3
  grep -h '^{' "$OUT/lora.log"
  ;;
cli)
  # `lmforge launch --nproc 1 pretrain` on real shards, 1B and 3B, against the planner
  step 500 cli python3 benchmarks/multi_gpu.py --rows 1b-1 3b-1 --steps 12 --warmup 4 \
    --out "$OUT"
  tail -n 6 "$OUT/cli.log"
  ;;
cli-post)
  # full SFT and full DPO on one GPU through the CLI, against the planner
  step 560 cli-post python3 benchmarks/multi_gpu.py --rows 1b-1-sft-full 1b-1-dpo-full \
    --steps 10 --warmup 3 --out "$OUT"
  tail -n 4 "$OUT/cli-post.log"
  ;;
memory)
  # the training planner against measured peaks, 19 setups (benchmarks/memory.py)
  step 580 memory python3 benchmarks/memory.py --out "$OUT"
  tail -n 21 "$OUT/memory.log"
  ;;
fsdp2)
  # two H200s: 1B and 3B as shipped (tied) on one GPU and on two under FSDP2 (target >= 1.9x), the 1B
  # also with bf16 reduce-scatters (parallel.reduce_dtype)
  step 560 fsdp2 python3 benchmarks/multi_gpu.py --rows 1b-1 1b-2 1b-2+bf16r 3b-1 3b-2 \
    --steps 12 --warmup 4 --out "$OUT"
  tail -n 8 "$OUT/fsdp2.log"
  ;;
fsdp2-post)
  # two H200s: TP 2 on the 3B, then 3B SFT with LoRA and DPO with LoRA on two GPUs, against the planner
  step 560 post python3 benchmarks/multi_gpu.py --rows 3b-tp2 3b-2-sft-lora 3b-2-dpo-lora \
    --steps 10 --warmup 3 --out "$OUT"
  tail -n 6 "$OUT/post.log"
  ;;
tp)
  # two H200s: 8B (random weights, bf16): decode tokens/s and eval seconds on one GPU and on two, with
  # the planner's figure beside each measured peak
  step 580 tp python3 benchmarks/tp_inference.py --rows eval-tp2 eval-tp1 generate-tp1 \
    generate-tp2 --work /tmp/tp-work --out "$OUT"
  tail -n 14 "$OUT/tp.log"
  ;;
decode)
  # batch 1, 128 new tokens, bf16 first for each preset's ratios; the 1B also with its output
  # projection quantized (`lmforge quantize --quantize-output`) and int4 in groups of 128 (the
  # others: 256, `lmforge quantize`'s default)
  decode_rows 320 1b bf16 int8-wo int4-wo int4-wo-g128 int8-wo-output int4-wo-output
  decode_rows 200 3b bf16 int8-wo int4-wo
  grep -h '^{' "$OUT"/decode-*.log | cut -c1-250
  ;;
decode-hf)
  # transformers' static-cache `generate` on the 1B's weights, for the decode table
  step 300 decode-hf python3 benchmarks/decode.py --presets llama3.2-1b --variants hf-static \
    --new-tokens 128 --repeats 2 --out "$OUT"
  grep -h '^{' "$OUT/decode-hf.log" | cut -c1-250
  ;;
serve)
  # the server at 1-64 streams (greedy), Generator's batch-1 rate in the same call for the
  # one-stream ratio, then sampled requests (temperature 1, top-k 50)
  step 220 serve python3 benchmarks/serve_load.py --preset llama3.2-1b --device cuda \
    --max-concurrency 64 --concurrency 1 8 32 64 --max-tokens 128 --max-seq-len 4096 \
    --out "$OUT"
  step 120 decode python3 benchmarks/decode.py --presets llama3.2-1b --variants lmforge \
    --schemes bf16 --new-tokens 128 --repeats 2 --out "$OUT/decode"
  step 200 sampled python3 benchmarks/serve_load.py --preset llama3.2-1b --device cuda \
    --max-concurrency 64 --concurrency 1 8 32 64 --max-tokens 128 --max-seq-len 4096 \
    --temperature 1 --top-k 50 --out "$OUT/sampled"
  tail -n 7 "$OUT/serve.log" "$OUT/sampled.log"
  grep -h '^{' "$OUT/decode.log" | cut -c1-250
  ;;
products)
  # the compiled quantized kernels against the dequantized products, then each block product
  # of the 1B (PRESET: another) at 1-128 rows: bf16, int8, int4, the kernel's VARIANTS and
  # GemLite's (quantized_gemm.py --variants)
  preset=${PRESET:-llama3.2-1b}
  gpu_tests 150 kernels tests/test_kernels.py -k "tiled or dequantized_product"
  step 400 products python3 benchmarks/quantized_gemm.py --preset "$preset" \
    --rows ${ROWS:-1 8 16 32 64 128} --variants ${VARIANTS:-swap swap-fast fast gemlite}
  tail -n 3 "$OUT/kernels.log"
  tail -n 40 "$OUT/products.log"
  ;;
fbgemm)
  # issue 56's kernel comparison: fbgemm-gpu-genai 1.6.0's CUTLASS sm90 int4 products
  # (preshuffled, plain) and W8A8 float8 (torch._scaled_mm with run-time activation scales, and
  # fbgemm's) beside cuBLAS bf16 and lmforge's kernels, the 1B's and the 8B's block products at
  # 1-128 rows. Carry a .whl of fbgemm-gpu-genai and pydantic's wheels alone (64 MiB a call).
  step 200 fbgemm-1b python3 benchmarks/quantized_gemm.py --preset llama3.2-1b \
    --rows 1 8 16 32 64 128 --variants fbgemm fp8
  step 60 fbgemm-1b-g128 python3 benchmarks/quantized_gemm.py --preset llama3.2-1b \
    --rows 1 8 64 --bits 16 --group 128 --variants fbgemm
  step 280 fbgemm-8b python3 benchmarks/quantized_gemm.py --preset llama3.1-8b \
    --rows 1 8 16 32 64 128 --bits 16 4 --variants fbgemm fp8
  cat "$OUT/fbgemm-1b-g128.log"
  tail -n 36 "$OUT/fbgemm-1b.log" "$OUT/fbgemm-8b.log"
  ;;
moe)
  # one Mixture-of-Experts feed-forward at qwen3-30b-a3b's shapes (PRESET: another), bf16: the
  # grouped path (torch._grouped_mm) against the per-expert loop, forward and backward, and at
  # 1-16 tokens the engine's fused small-batch path (forward without autograd); then batch-1
  # decode of the preset shortened to 24 blocks (random weights, bf16; the fused path on), its
  # limit counted on the bytes a token reads (attention, the chosen experts, the output
  # projection)
  step 180 moe python3 benchmarks/moe_layer.py --preset "${PRESET:-qwen3-30b-a3b}" \
    --tokens 1 8 16 512 16384
  TRITON_CACHE_DIR=/tmp/triton-moe step 240 decode-moe python3 benchmarks/decode.py \
    --presets "${PRESET:-qwen3-30b-a3b}" --num-layers 24 --variants lmforge --schemes bf16 \
    --new-tokens 128 --repeats 2 --profile 16 --out "$OUT/moe"
  tail -n 24 "$OUT/moe.log"
  grep -h -A16 '^kernels' "$OUT/decode-moe.log" | cut -c1-160
  grep -h '^{' "$OUT/decode-moe.log" | cut -c1-250
  ;;
int4-mma)
  # issue 56's own int4 product (lmforge/generate/kernels/cuda/int4_mma.cu, built here at first
  # use): its GPU tests against the dequantized weights, then the 8B's block products at 1-64
  # rows beside bf16 and Triton's int4 (group 256, the default), with the best launch found,
  # then the 1B's `lmforge quantize --scheme int4-wo` artifact served at 1-64 streams with the
  # engine's int4 at 2-64 rows in the kernel (LMFORGE_INT4_MMA=1; bf16 and Triton's int4 are
  # the "Serving" / "Quantized" rows: start and quantize take ~120 s, two serves do not fit)
  gpu_tests 150 int4-mma-tests tests/test_int4_mma.py -x
  tail -n 25 "$OUT/int4-mma-tests.log"
  grep -q " passed" "$OUT/int4-mma-tests.log" && ! grep -q "failed" "$OUT/int4-mma-tests.log" || exit 1
  step 130 int4-mma-8b python3 benchmarks/quantized_gemm.py --preset llama3.1-8b \
    --rows 1 2 8 16 32 64 --bits 16 4 --variants mma
  cat "$OUT/int4-mma-8b.log"
  LMFORGE_INT4_MMA=1 step 280 int4-mma-serve python3 benchmarks/serve_load.py \
    --preset llama3.2-1b --device cuda --schemes int4-wo --max-concurrency 64 \
    --concurrency 1 8 32 64 --max-tokens 128 --max-seq-len 4096 --out "$OUT/int4-mma-serve"
  tail -n 8 "$OUT/int4-mma-serve.log"
  ;;
moe-quantized)
  # batch-1 decode of case moe's model with its experts int8 (a scale a row) and int4 (two a
  # byte, a scale per 128 columns) as lmforge holds a compressed-tensors artifact's
  # (QuantizedExperts; attention bf16), read by the fused kernels, after bf16 for the ratios;
  # first one layer's quantized experts, fused kernels against dequantize + grouped at 1-64
  # tokens with the fused outputs' errors (benchmarks/moe_quantized_layer.py: where
  # QUANTIZED_FUSED_PAIRS belongs)
  step 100 moe-quantized-layer python3 benchmarks/moe_quantized_layer.py \
    --preset "${PRESET:-qwen3-30b-a3b}" --out "$OUT"
  tail -n 16 "$OUT/moe-quantized-layer.log"
  for scheme in bf16 int8-experts int4-experts; do
    TRITON_CACHE_DIR=/tmp/triton-moe step 160 "decode-moe-$scheme" python3 benchmarks/decode.py \
      --presets "${PRESET:-qwen3-30b-a3b}" --num-layers 24 --variants lmforge --schemes "$scheme" \
      --new-tokens 128 --repeats 2 --out "$OUT/moe-$scheme"
  done
  grep -h '^{' "$OUT"/decode-moe-*.log | cut -c1-250
  ;;
eval-share)
  # lm-eval's multiple-choice scoring on the 1B (random bf16 weights): 256 questions of ~256
  # tokens with 4 choices, batch 8, each choice with its whole question (--no-share-contexts)
  # against a question's choices in one row (the default). Issue 57's eval row
  step 240 eval-share python3 benchmarks/eval_share.py --preset llama3.2-1b --questions 256 \
    --context 256 --batch 8 --out "$OUT"
  tail -n 3 "$OUT/eval-share.log"
  ;;
gpt-oss)
  # batch-1 decode of gpt-oss-20b (random weights; attention through SDPA with its sinks, the
  # experts in the fused kernels) in bf16 (~42 GB) and with its experts kept as the hub's MXFP4
  # (`QuantizedExperts`, as generate / serve hold them: ~13 GB), each its own process
  for scheme in bf16 mxfp4-experts; do
    TRITON_CACHE_DIR=/tmp/triton-gpt-oss step 270 "decode-gpt-oss-$scheme" python3 \
      benchmarks/decode.py --presets gpt-oss-20b --variants lmforge --schemes "$scheme" \
      --new-tokens 128 --repeats 2 --out "$OUT/gpt-oss-$scheme"
  done
  grep -h '^{' "$OUT"/decode-gpt-oss-*.log | cut -c1-250
  ;;
moe-train)
  # one GPU (H100 or H200; ~50 GiB by the planner): training tokens/s at qwen3-30b-a3b's shapes
  # cut to 4 blocks (3.11B parameters, 0.54B active matmul ones; batch 4 x 2048, random tokens,
  # compile on, no AC), torchtitan 0.2.2's own Qwen3-MoE (benchmarks/titan_moe.py: fp32 weights
  # under bf16 autocast, fused AdamW) beside lmforge's step with bf16 weights and fp32 masters
  # (its one-GPU default) and with fp32 weights under autocast (titan's precision); MFU on the
  # active parameters' FLOPs, counted alike on both sides (targets: >= 1.0x, >= 25% MFU)
  step 200 titan-moe torchrun --nproc_per_node 1 benchmarks/titan_moe.py --num-layers 4 \
    --batch 4 --seq 2048 --steps 10 --warmup 4 --out "$OUT"
  step 250 ours-moe python3 benchmarks/train_throughput.py --shapes moe:4x2048 --num-layers 4 \
    --variants ours-compile-bf16p ours-compile --steps 10 --warmup 4 --out "$OUT"
  grep -h '^{' "$OUT/titan-moe.log" "$OUT/ours-moe.log"
  python3 -c "import json,sys; t=json.load(open(sys.argv[1]))['tokens_per_s']; \
    [print(r['variant'], 'over torchtitan:', round(r['tokens_per_s'] / t, 3)) for r in \
    json.load(open(sys.argv[2]))['rows'] if 'tokens_per_s' in r]" \
    "$OUT/titan_moe.json" "$OUT/train_throughput.json"
  ;;
moe-lora)
  # one GPU (H100 or H200): a LoRA training step at moe-train's shapes (qwen3-30b-a3b cut to 4
  # blocks, batch 4 x 2048, random tokens, rank 16 on attention's q/k/v/o and the experts, the
  # aux loss on), transformers 5 + PEFT (benchmarks/hf_peft_moe.py: grouped_mm experts, PEFT's
  # target_parameters on the stacked experts, bf16 autocast, fused AdamW) eager and with each
  # decoder layer compiled, beside lmforge's LoRA step, compiled (target: >= 2x the faster row)
  step 100 hf-peft-moe python3 benchmarks/hf_peft_moe.py --num-layers 4 --batch 4 --seq 2048 \
    --steps 10 --warmup 4 --out "$OUT"
  step 150 hf-peft-moe-compile python3 benchmarks/hf_peft_moe.py --num-layers 4 --batch 4 \
    --seq 2048 --steps 10 --warmup 4 --compile --out "$OUT"
  step 200 ours-moe-lora python3 benchmarks/train_throughput.py --shapes moe:4x2048 \
    --num-layers 4 --variants ours-lora-compile --steps 10 --warmup 4 --out "$OUT"
  grep -h '^{' "$OUT"/hf-peft-moe*.log "$OUT/ours-moe-lora.log" | cut -c1-400
  python3 -c "import json,os,sys; ours=[r for r in json.load(open(sys.argv[1]))['rows'] \
    if 'tokens_per_s' in r]; [print(r['variant'], 'over', h['engine'], 'compile' if \
    h['compile'] else 'eager', round(r['tokens_per_s'] / h['tokens_per_s'], 3)) for f in \
    sys.argv[2:] if os.path.exists(f) for h in [json.load(open(f))] for r in ours]" \
    "$OUT/train_throughput.json" "$OUT/hf_peft_moe.json" "$OUT/hf_peft_moe-compile.json"
  ;;
fp8)
  # batch-1 decode of the 1B in bf16, fp8 (W8A8, `lmforge quantize --scheme fp8`'s weights in
  # the engine's Float8Linear: one row in the GEMV, weight-only) and int8-wo, then the fp8
  # artifact served beside bf16: case quantized-serve with SCHEMES="bf16 fp8"
  decode_rows 280 1b bf16 fp8 int8-wo
  grep -h '^{' "$OUT"/decode-*.log | cut -c1-250
  ;;
quantized-serve)
  # the random 1B (PRESET=llama3.1-8b: the 8B) artifact as it is (bf16) and as `lmforge quantize
  # --scheme int8-wo|int4-wo` makes it with its defaults (SCHEMES: which; the 8B's three do not
  # fit one call: "bf16 int4-wo", then "bf16 int8-wo"), each served at 1-64 streams (greedy).
  # SCHEME/FORMAT quantizes with --format FORMAT (int4-wo/compressed-tensors: vLLM's format,
  # loaded by lmforge as its own int4). The kernels' own tests and products: cases check and
  # products.
  preset=${PRESET:-llama3.2-1b}
  step 570 "qserve-$preset" python3 benchmarks/serve_load.py --preset "$preset" --device cuda \
    --schemes ${SCHEMES:-bf16 int4-wo int8-wo} --max-concurrency 64 --concurrency 1 8 32 64 \
    --max-tokens 128 --max-seq-len 4096 --out "$OUT/$preset"
  tail -n 30 "$OUT/qserve-$preset.log"
  ;;
structured-serve)
  # the 1B served at 32 streams (128 tokens a request), then the same with every second
  # request constrained by a JSON schema (response_format, xgrammar's masks in the engine's
  # step). Target (issue 57): the constrained run's tokens/s >= 90% of the plain one's
  for every in 0 2; do
    step 280 "structured-$every" python3 benchmarks/serve_load.py --preset llama3.2-1b \
      --device cuda --max-concurrency 32 --concurrency 32 --max-tokens 128 \
      --max-seq-len 4096 --json-every "$every" --out "$OUT/structured-$every"
    tail -n 4 "$OUT/structured-$every.log"
  done
  ;;
prefix-serve)
  # the 1B served at 32 streams, every prompt a shared ~1,000-token system prompt (700 words
  # of the benchmark's BPE) and its own 16 words, 64 new tokens: prefix caching on (default)
  # and off (--prefix-cache-tokens 0). Target (issue 57): p50 TTFT >= 3x lower, tokens/s
  # >= 1.5x higher with it on
  for cache in default 0; do
    extra=()
    [ "$cache" = default ] || extra=(--prefix-cache-tokens "$cache")
    step 280 "prefix-$cache" python3 benchmarks/serve_load.py --preset llama3.2-1b \
      --device cuda --max-concurrency 32 --concurrency 32 --max-tokens 64 \
      --max-seq-len 2048 --shared-prefix-words 700 "${extra[@]}" --out "$OUT/prefix-$cache"
    tail -n 4 "$OUT/prefix-$cache.log"
  done
  ;;
adapters-serve)
  # the 1B served at 32 streams (128 tokens a request), then with 8 random rank-16 LoRA
  # adapters on every q/k/v/o and MLP linear (--lora), request i naming adapter i mod 8.
  # Target (issue 57): the adapters' tokens/s >= 70% of the base model's
  for adapters in 0 8; do
    step 280 "adapters-$adapters" python3 benchmarks/serve_load.py --preset llama3.2-1b \
      --device cuda --max-concurrency 32 --concurrency 32 --max-tokens 128 \
      --max-seq-len 4096 --adapters "$adapters" --out "$OUT/adapters-$adapters"
    tail -n 4 "$OUT/adapters-$adapters.log"
  done
  ;;
moe-serve)
  # lmforge serve on qwen3-30b-a3b's shapes cut to 24 blocks (random bf16 weights, ~30 GB) at
  # 1-64 streams, 128 greedy tokens a request: the MoE beside the dense rows of case serve
  step 570 serve-moe python3 benchmarks/serve_load.py --preset qwen3-30b-a3b --num-layers 24 \
    --device cuda --max-concurrency 64 --concurrency 1 8 32 64 --max-tokens 128 \
    --max-seq-len 4096 --out "$OUT/moe-serve"
  tail -n 12 "$OUT/serve-moe.log"
  ;;
quantized-8b)
  # the 8B (random weights) bf16 and as `lmforge quantize` makes it with its defaults: `lmforge
  # generate` at batch 1 (decode tokens/s, % of the copy-bandwidth limit, load time) and `lmforge
  # eval` on the demo's task, each peak beside the inference planner's; a fresh Triton cache,
  # so each generate row's "compiled in" is a first tune (290.7 s for int8 on 2026-12-05)
  TRITON_CACHE_DIR=/tmp/triton-qinfer-$$ step 570 qinfer-8b python3 benchmarks/tp_inference.py \
    --rows generate-tp1 eval-tp1 \
    --schemes bf16 int4-wo int8-wo --work /tmp/tp-work --out "$OUT/qinfer"
  grep -h '^generate\|^eval\|^quantized\|^wrote' "$OUT/qinfer-8b.log" | cut -c1-400
  ;;
tiles)
  # the GEMV's tiles searched inside the decode step from the pinned ones, 1B and 3B (PRESETS:
  # others, e.g. llama3.1-8b, whose products have no pinned tile yet; SCHEMES: fewer schemes,
  # the 8B's one or two a call, its int8 alone tuned for 290 s), merged into
  # $OUT/gemv_tiles.json (to commit over `tiles.TILES`, the table lmforge reads, if faster)
  cp "$(python3 -c 'from lmforge.generate.kernels import tiles; print(tiles.TILES)')" "$OUT/gemv_tiles.json"
  presets=${PRESETS:-llama3.2-1b llama3.2-3b}
  for preset in $presets; do  # the call's 560 s shared among the presets
    TRITON_CACHE_DIR=/tmp/triton-tiles-$preset step $((560 / $(wc -w <<<"$presets"))) \
      "tiles-$preset" python3 \
      benchmarks/tile_search.py --preset "$preset" --schemes ${SCHEMES:-bf16 int8-wo int4-wo} \
      --passes 1 --tokens 64 --out "$OUT/$preset" --table "$OUT/gemv_tiles.json"
  done
  grep -h '^{' "$OUT"/tiles-*.log | cut -c1-200
  ;;
grpo)
  # a GRPO step on the 1B (64 prompts x G 8, 128-token prompts, 256 new tokens) timed part by
  # part beside the engine's own batched generate (benchmarks/grpo_step.py), then through the
  # CLI (grpo_cli.py), after the engine's GPU tests of giving its cache back and taking it again
  gpu_tests 150 generate tests/test_generate.py -k "cache_back or greedy_tokens_chosen"
  gpu_tests 120 grpo-tests tests/test_grpo.py -k compiled_rollout_engine
  step 250 grpo python3 benchmarks/grpo_step.py --preset 1b --prompts 64 --generations 8 \
    --new-tokens 256 --prompt-len 128 --out "$OUT" --profile /tmp/grpo-profile
  cat /tmp/grpo-profile/*.txt >>"$OUT/grpo.log"  # (at most 8 files come back from a call)
  # the same shapes through `lmforge grpo` itself (its loop, optimizer and logging)
  step 240 grpo-cli python3 benchmarks/grpo_cli.py --preset 1b --prompts 64 --generations 8 \
    --new-tokens 256 --prompt-len 128 --out "$OUT"
  tail -n 3 "$OUT/generate.log" "$OUT/grpo-tests.log"
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); [print({k: round(v, 4) for k, v \
    in s.items()}) for s in d['steps']]; print('peak GiB', d['peak_gib'], 'plan (allocated)', \
    d.get('plan_allocated_gib'), 'plan (total)', d.get('plan_total_gib'))" "$OUT/grpo_cli.json"
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(d['generate']); \
    [print({k: round(v, 4) for k, v in s.items()}) for s in d['grpo_steps']]; \
    print('rollout/generate', d['rollout_vs_generate'])" "$OUT/grpo_step.json"
  ;;
grpo-ab)
  # the grpo case's two runs again with what may make them faster: grpo_step.py sampling from
  # fused q/k/v and gate/up copies (grpo.fuse_rollouts: its rollout row) and sharing a group's
  # prompt in the update (grpo.share_prompts: its update row); `lmforge grpo` with both and its
  # blocks compiled for the update (parallel.compile)
  step 250 grpo-options python3 benchmarks/grpo_step.py --preset 1b --prompts 64 \
    --generations 8 --new-tokens 256 --prompt-len 128 --out "$OUT" --fuse-rollouts \
    --share-prompts
  step 300 grpo-cli-compile python3 benchmarks/grpo_cli.py --preset 1b --prompts 64 \
    --generations 8 --new-tokens 256 --prompt-len 128 --out "$OUT" --tag compile \
    parallel.compile=true grpo.fuse_rollouts=true grpo.share_prompts=true
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(d['generate']); \
    [print({k: round(v, 4) for k, v in s.items()}) for s in d['grpo_steps']]; \
    print('options: rollout/generate', d['rollout_vs_generate'])" "$OUT/grpo_step_options.json"
  python3 -c "import json,sys; [print('compile', {k: round(v, 4) for k, v in s.items()}) for s \
    in json.load(open(sys.argv[1]))['steps']]" "$OUT/grpo_cli-compile.json"
  ;;
grpo-2gpu)
  # two H200s: `lmforge grpo` on grpo's 1B shapes over two GPUs, FSDP 2 (each GPU samples half
  # of the prompts on a gathered bf16 replica) and TP 2 (the engine over the policy's shards,
  # its collectives on NCCL inside the CUDA graphs)
  step 280 grpo-fsdp2 python3 benchmarks/grpo_cli.py --preset 1b --prompts 64 --generations 8 \
    --new-tokens 256 --prompt-len 128 --nproc 2 --tag fsdp2 --out "$OUT" \
    train.micro_batch_size=16
  step 280 grpo-tp2 python3 benchmarks/grpo_cli.py --preset 1b --prompts 64 --generations 8 \
    --new-tokens 256 --prompt-len 128 --nproc 2 --tag tp2 --out "$OUT" parallel.tp=2
  for tag in fsdp2 tp2; do
    python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(sys.argv[2]); \
      [print({k: round(v, 4) for k, v in s.items()}) for s in d['steps']]" \
      "$OUT/grpo_cli-$tag.json" "$tag"
  done
  ;;
moe-2gpu)
  # two H200s: qwen3-30b-a3b's shapes cut to 4 blocks (128 experts, top-8; random weights),
  # `lmforge launch --nproc N pretrain` tokens/s on one GPU, on two under FSDP2 (each expert
  # sharded over both) and on two with parallel.ep=2 (64 experts a GPU, tokens by all-to-all);
  # no compile in any row (expert parallelism does not take it yet). Not run yet.
  step 580 moe-2gpu python3 benchmarks/multi_gpu.py --rows moe-1 moe-2 moe-ep2 \
    --steps 10 --warmup 3 --out "$OUT"
  tail -n 6 "$OUT/moe-2gpu.log"
  ;;
trl)
  # TRL's GRPOTrainer on grpo's shapes, seconds a step: with transformers' generate (its default
  # without vLLM), then with transformers' continuous batching
  step 300 trl python3 benchmarks/trl_grpo.py --preset 1b --prompts 64 --generations 8 \
    --new-tokens 256 --prompt-len 128 --out "$OUT"
  step 280 trl-cb python3 benchmarks/trl_grpo.py --preset 1b --prompts 64 --generations 8 \
    --new-tokens 256 --prompt-len 128 --continuous-batching
  tail -n 24 "$OUT/trl.log" "$OUT/trl-cb.log"
  ;;
check)
  # the GPU-only tests: the kernels compiled, the engine's graphs, the training kernels
  gpu_tests 240 kernels tests/test_kernels.py
  gpu_tests 150 generate tests/test_generate.py -k "dropped_engine or greedy_tokens_chosen"
  gpu_tests 60 train-kernels tests/test_train_kernels.py
  tail -n 3 "$OUT/kernels.log" "$OUT/generate.log" "$OUT/train-kernels.log"
  ;;
esac
grep -h -c Traceback "$OUT"/*.log || true
