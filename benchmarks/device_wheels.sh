#!/usr/bin/env bash
# The Python packages the benchmarks need on the GPU machine that its image lacks, as wheels for
# its Python 3.12 (x86-64) in .whl/ (ignored by git; name it in the device call's `carry`):
# lmforge's own (torchao, pydantic, lm-eval, the server's), torchtitan 0.2.2 and its needs (the
# side-by-side training reference, ../shared/bench/titan_baseline.py, copied in too), py-spy
# (serve_load.py --profile-server) and gemlite (decode.py's int4-gemlite / int8-gemlite schemes,
# through torchao's UIntxWeightOnlyConfig). Versions follow constraints.txt where it names them.
# Each device call then starts with:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#     --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH
#
# `bash benchmarks/device_wheels.sh mslk` instead fills .whl-mslk/ for `device_calls.sh mslk`
# (carry [".whl-mslk"]): torchao and pydantic, and mslk-cuda (the Hopper kernels of torchao's
# preshuffled int4 layout, formerly fbgemm-gpu-genai's; 42 MiB, too large to travel beside
# .whl/ within a call's 64 MiB).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = mslk ]; then
  grep -qx '/.whl-mslk/' .git/info/exclude 2>/dev/null || echo /.whl-mslk/ >>.git/info/exclude
  mkdir -p .whl-mslk
  for spec in torchao pydantic pydantic-core annotated-types typing-inspection mslk-cuda==1.1.0; do
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
      --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
      -d .whl-mslk "$(grep -i -m1 "^$spec==" constraints.txt || echo "$spec")"
  done
  du -sh .whl-mslk
  exit 0
fi
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
  py-spy
)
specs=()
for name in "${packages[@]}"; do specs+=("$(pinned "$name")"); done
[ -n "$(grep -i -m1 '^torchtitan==' constraints.txt || true)" ] || specs=("${specs[@]/#torchtitan/torchtitan==0.2.2}")

platforms=()
for n in 17 24 27 28 31 34; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
platforms+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)
# gemlite, sqlitedict and word2number ship only source distributions (pure Python): built here.
# gemlite 0.5: 0.6's get_tensor_args returns four tensors where torchao 0.18 unpacks three.
specs+=(gemlite==0.5.1.post1)
for spec in "${specs[@]}"; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${platforms[@]}" -d .whl "$spec" 2>/dev/null ||
    python3 -m pip wheel -q --no-deps -w .whl "$spec"
done
cp ../shared/bench/titan_baseline.py .whl/ 2>/dev/null || echo "../shared/bench/titan_baseline.py not found" >&2
du -sh .whl
