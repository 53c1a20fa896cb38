#!/usr/bin/env bash
# Compile the decode kernels for sm_90 with the GPU machine's Triton (3.6), here, without a GPU: a
# kernel that compiles with this machine's Triton may not with another (docs/inference.md). Run it
# before a device call that brings new kernel code: bash benchmarks/compile_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
version=${TRITON_VERSION:-3.6.0}
target=/tmp/triton-$version
if [ ! -d "$target/triton" ]; then
  python3 -m pip download -q --no-deps "triton==$version" -d "$target-wheel"
  python3 -m pip install -q --no-deps --target "$target" "$target-wheel"/triton-*.whl
fi
script=$(python3 - <<'PY'
import re
source = open("tests/test_kernels.py").read()
print(re.search(r'COMPILE_FOR_SM90 = """(.*?)"""', source, re.S).group(1))
PY
)
env -u TRITON_INTERPRET PYTHONPATH="$target:$PWD" python3 -c "$script"
