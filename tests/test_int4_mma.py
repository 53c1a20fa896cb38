"""The CUDA int4 product (lmforge/generate/kernels/int4_mma.py, cuda/int4_mma.cu): its packed
layout read back as the kernel reads it (anywhere), its source compiled for sm_90 by nvcc with
no register spills (where nvcc is: `make test` installs it in .nvcc), and on a GPU its products
against the dequantized weight's, for every launch config, split count and row count it takes,
inside a CUDA graph too.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from lmforge.generate.kernels import dequantize, int4_mma

ROOT = Path(__file__).resolve().parents[1]


def random_int4(n: int, k: int, group: int, device="cpu", seed: int = 0):
    """lmforge's int4 layout: uint8 q [N, K/2] (q[j] | q[j + K/2] << 4), bf16 scale, zero."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.uint8)
    scale = (torch.rand(n, k // group, generator=g) * 0.02 + 0.001).bfloat16()
    zero = ((torch.rand(n, k // group, generator=g) - 0.5) * 0.01).bfloat16()
    return q.to(device), scale.to(device), zero.to(device)


@pytest.mark.parametrize(("n", "k", "group"), [(128, 64, 32), (256, 256, 128), (192, 128, 64)])
def test_the_packed_weight_reads_back_as_the_kernel_reads_it(n, k, group):
    q, scale, zero = random_int4(n, k, group, seed=n + k)
    words, sz = int4_mma.pack(q, scale, zero)
    assert words.dtype == torch.int32 and words.shape == (n // 64, k // 32, 2, 32, 4)
    assert sz.shape == (k // group, n // 64, 8, 4, 2)
    values, scale_back, zero_back = int4_mma.unpack(words, sz, n, k)
    assert torch.equal(values, torch.cat([q & 15, q >> 4], dim=1))
    assert torch.equal(scale_back, scale) and torch.equal(zero_back, zero)


def test_the_launch_fills_the_processors_within_k():
    assert int4_mma.config(1, 4096, 4096, 132) == (5, 4)  # 32 blocks of 128 columns
    assert int4_mma.config(8, 28672, 4096, 132) == (5, 1)  # 224 blocks: no split
    assert int4_mma.config(20, 2048, 512, 132) == (6, 1)  # K = 512: 16 steps for 4 warps
    assert int4_mma.config(64, 2048, 8192, 132)[0] == 7
    assert not int4_mma.supported(65, 128, 64, 32) and not int4_mma.supported(2, 192, 64, 32)
    assert int4_mma.supported(64, 256, 256, 128) and not int4_mma.supported(8, 256, 256, 48)


def _nvcc() -> str | None:
    local = ROOT / ".nvcc" / "nvidia" / "cu13" / "bin" / "nvcc"
    return str(local) if local.exists() else shutil.which("nvcc")


@pytest.mark.skipif(_nvcc() is None, reason="no nvcc (`make test` installs one in .nvcc)")
def test_the_kernel_compiles_for_hopper_without_spills(tmp_path):
    source = Path(int4_mma.__file__).parent / "cuda" / "int4_mma.cu"
    result = subprocess.run(
        [_nvcc(), "-arch=sm_90", "-cubin", "-O3", "-Xptxas", "-v", "-o", str(tmp_path / "k.cubin"),
         str(source)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    kernels = re.findall(r"Compiling entry function '(\w+)'", result.stderr)
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", result.stderr)
    assert len(kernels) == len(int4_mma.CONFIGS) == len(spills)
    assert all(s == ("0", "0") for s in spills), result.stderr


gpu = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 8,
    reason="a CUDA GPU of compute capability 8.0+",
)


@gpu
@pytest.mark.parametrize(("n", "k", "group"), [(256, 512, 128), (384, 1024, 32), (4096, 4096, 128)])
def test_the_product_equals_the_dequantized_weights(n, k, group):
    reason = int4_mma.available()
    assert reason is None, reason  # a GPU machine has nvcc: the build must work there
    q, scale, zero = random_int4(n, k, group, device="cuda", seed=n)
    words, sz = int4_mma.pack(q, scale, zero)
    int4_mma.reserve(n, q.device)
    w = dequantize(q, scale, zero, 4, torch.bfloat16)
    torch.manual_seed(0)
    for rows in (1, 2, 7, 16, 17, 33, 64):
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        ref = x.float() @ w.float().t()
        fits = [c for c, (tiles, columns, _) in int4_mma.CONFIGS.items()
                if 16 * tiles >= rows and n % columns == 0]  # fmt: skip
        for which in fits:
            for splits in (1, 3, 4 if rows > 32 else 8):
                y = int4_mma.int4_mma(x, words, sz, group, which, splits)
                again = int4_mma.int4_mma(x, words, sz, group, which, splits)
                assert torch.equal(y, again)  # the split sums added in one order
                error = (y.float() - ref).norm() / ref.norm()
                assert error < 4e-3, (rows, which, splits, error.item())
        auto = int4_mma.int4_mma(x, words, sz, group)  # the launch `config` picks
        assert ((auto.float() - ref).norm() / ref.norm()) < 4e-3


@gpu
def test_the_product_replays_in_a_cuda_graph():
    assert int4_mma.available() is None
    n, k, group = 512, 2048, 128
    q, scale, zero = random_int4(n, k, group, device="cuda")
    words, sz = int4_mma.pack(q, scale, zero)
    int4_mma.reserve(n, q.device)
    x = torch.randn(8, k, device="cuda", dtype=torch.bfloat16)
    eager = int4_mma.int4_mma(x, words, sz, group, 0, 4)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = int4_mma.int4_mma(x, words, sz, group, 0, 4)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)


@gpu
def test_a_quantized_layer_takes_the_kernel_between_2_and_64_rows(monkeypatch):
    from lmforge.generate.kernels import QuantizedLinear, layers, use_int4_mma

    monkeypatch.setattr(layers, "INT4_MMA", True)  # (off by default: LMFORGE_INT4_MMA=1)

    q, scale, zero = random_int4(256, 512, 128, device="cuda")
    model = torch.nn.Sequential(QuantizedLinear(q, scale, zero, 4))
    assert use_int4_mma(model) == 1 and len(model[0].mma) == 2
    w = dequantize(q, scale, zero, 4, torch.bfloat16)
    for rows in (2, 64, 65):  # 65: Triton's product
        x = torch.randn(rows, 512, device="cuda", dtype=torch.bfloat16)
        ref = x.float() @ w.float().t()
        assert ((model(x).float() - ref).norm() / ref.norm()) < 4e-3


def test_without_a_gpu_the_product_says_why():
    if torch.cuda.is_available():
        pytest.skip("a GPU is here")
    assert int4_mma.available() == "no CUDA device"
