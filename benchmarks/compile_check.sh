#!/usr/bin/env bash
# Compile the decode kernels for an H100/H200 (sm_90) with the Triton the GPU machine has (3.6,
# beside its torch 2.11), here, without a GPU: tests/test_kernels.py's compile check runs with
# this machine's Triton, and a kernel that compiles with one version may not with another
# (2026-12-02: a constraint string built in a kernel compiled with Triton 3.9, not 3.6, and cost
# a device call). Run it before a device call that brings new kernel code:
#   bash benchmarks/compile_check.sh
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
