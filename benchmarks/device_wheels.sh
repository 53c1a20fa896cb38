#!/usr/bin/env bash
# The Python packages the GPU machine's image lacks (lmforge's own, torchtitan 0.2.2 and its
# needs, ../shared/bench/titan_baseline.py, GemLite for benchmarks/quantized_gemm.py, TRL for
# benchmarks/trl_grpo.py, PEFT for benchmarks/hf_peft_moe.py (the image's may predate its
# target_parameters), compressed-tensors for `lmforge quantize --format compressed-tensors`), as
# wheels for its Python 3.12 in .whl/ (ignored by git; carry it), versions from constraints.txt;
# benchmarks/device_calls.sh installs them.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >>.git/info/exclude
mkdir -p .whl

pinned() {  # NAME -> NAME==VERSION from constraints.txt, else NAME
  local line
  line=$(grep -i -m1 "^$1==" constraints.txt || true)
  echo "${line:-$1}"
}

packages=(
  torchao pydantic pydantic-core annotated-types typing-inspection tomli-w
  fastapi opentelemetry-api starlette uvicorn httptools prometheus-client openai jiter distro sniffio
  lm-eval evaluate datasets dill multiprocess sqlitedict pytablewriter dataproperty mbstrdecoder
  tabledata tcolorpy typepy chardet word2number more-itertools zstandard rouge-score nltk
  jsonlines numexpr tqdm-multiprocess
  torchtitan tyro typeguard docstring-parser torchdata tomli
  gemlite trl peft compressed-tensors loguru xgrammar apache-tvm-ffi
)
specs=()
for name in "${packages[@]}"; do specs+=("$(pinned "$name")"); done
[ -n "$(grep -i -m1 '^torchtitan==' constraints.txt || true)" ] || specs=("${specs[@]/#torchtitan/torchtitan==0.2.2}")

platforms=()
for n in 17 24 27 28 31 34; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
platforms+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)
# sqlitedict and word2number ship only source distributions (pure Python): built here.
for spec in "${specs[@]}"; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${platforms[@]}" -d .whl "$spec" 2>/dev/null ||
    python3 -m pip wheel -q --no-deps -w .whl "$spec"
done
cp ../shared/bench/titan_baseline.py .whl/ 2>/dev/null || echo "../shared/bench/titan_baseline.py not found" >&2
du -sh .whl
