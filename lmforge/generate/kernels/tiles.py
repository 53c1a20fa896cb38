"""Tiles and autotuning of both GEMV kernels: the tile shapes each product may try (`_ROW_WIDE`
and the other lists, `_INT4_TILES`), the configs they make (`_gemv_configs`, `_int4_configs`)
and the autotuner's pruning to one product's candidates (`_candidates`, `_int4_candidates`);
split-K's and folding's switches (`SPLIT_K`, `FOLD`); the table of tiles pinned per GPU
(`TILES`: lmforge/generate/gemv_tiles.json, or LMFORGE_GEMV_TILES) that a product runs untuned
(`_fits`, `_int4_fits`); the tuner all three kernels use (`autotune`: picks kept in Triton's
cache, candidates compiled on threads); and the one configuration Triton's interpreter runs
(`INTERPRETED_*`: the tests set them to reach each path).
"""

from __future__ import annotations

import json
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from pathlib import Path

import torch
import triton
from triton.runtime.autotuner import Autotuner

from lmforge.generate.kernels.int8 import int8_biased

log = logging.getLogger(__name__)


# (BLOCK_N, num_warps, num_stages) the autotuner tries at a tile width: the winners over the 1B
# and 3B presets' shapes on an H200 out of 2-16 rows × 4 or 8 warps × 1 or 3 stages (2026-12-01,
# docs/benchmarks.md), so that a model tunes in seconds. Where one scale covers a row, at the
# widest width that divides it and at half that width; where scales are grouped, at the group.
_ROW_WIDE = [(2, 4, 1), (2, 4, 3), (4, 8, 1), (8, 8, 3)]
_ROW_HALF = [(4, 4, 3), (8, 8, 3)]
_GROUPED = [(16, 8, 3), (8, 8, 1), (8, 8, 3), (4, 4, 3)]
# Where the product takes a norm or SiLU·up (one scale a row), also 8 rows a program with 4
# warps: the best in a search over 2-32 rows, 512-2048 columns, 4/8 warps, 1/3 stages, x as
# tile or vector (benchmarks/gemv_search.py on an H200, 2026-12-02, weights warm in L2: 1B w13
# with its norm 18.45 us against 19.66 for the plain products' tiles). Tried alone in the
# engine, bf16's products took 0.782 ms of the 1B step instead of 0.803, but int8 decoded 11%
# slower (1,085 against 1,217 tok/s): the autotuner, which flushes L2, picks among both sets.
_FUSED_WIDE = [(8, 4, 3), (8, 8, 3), (4, 4, 3)]
_FUSED_HALF = [(8, 4, 3), (8, 8, 3)]
# int8 of one scale a row, folded (`_fold`; config FOLD is set on these shapes only, none of
# which is in the lists above): fewer warps for the rows, so a thread holds 4-16 of them and
# loads and converts each x it needs once for all (a warp spans 512 columns at 16 bytes a
# thread, so at 1024 columns two warps share a row's width). Session 22's count (sm_90): the
# 1B's int8 w2 at 2 rows a program spends 6.6 instructions a weight (Nsight Compute), one x
# conversion a weight among them.
_ROW_DEEP = [(8, 2, 3), (16, 4, 3), (16, 2, 3), (32, 4, 3), (8, 2, 1), (16, 4, 1)]

MIN_TILE = 16  # the narrowest K tile: a row (and a group) must be a multiple of it
_WIDTHS = (1024, 512, 256, 128, 64, 32, MIN_TILE)

# Split-K (`_combine`): a product without a norm or SiLU·up may share each row's columns among
# 2 or 4 programs, tuned like a tile (pinned as `... kSPLITS`). Long rows over few rows (w2:
# 8,192 columns, 2,048 rows on the 1B) otherwise leave one program an SM reading one tile at a
# time. On an H200 (2026-12-02, docs/benchmarks.md) the autotuner split the int4 1B's w2 in 4
# and the 3B's wo in 2, and int4 decoded 3.4% (1B) and 3.0% (3B) faster; bf16 and int8 kept
# whole rows. False: never (benchmarks/decode.py, variant lmforge-no-split).
SPLIT_K = True
# int8 products of one scale a row may take folded sums (`_fold`) and the deep tiles
# (`_ROW_DEEP`), chosen like a tile. False: neither is a candidate.
FOLD = True
SPLIT_COUNTS = (1, 2, 4)


def _gemv_configs() -> list[triton.Config]:
    shapes = {*_ROW_WIDE, *_ROW_HALF, *_GROUPED, *_FUSED_WIDE, *_FUSED_HALF, *_ROW_DEEP}
    return [
        triton.Config(
            {
                "BLOCK_N": n,
                "BLOCK_K": k,
                "X_TILE": tile,
                "INT8_BIASED": biased,
                "SPLITS": splits,
                "FOLD": fold,
            },
            num_warps=w,
            num_stages=s,
        )
        for k in _WIDTHS
        for n, w, s in sorted(shapes)
        for tile in (False, True)
        for biased in (False, True)
        for splits in SPLIT_COUNTS
        for fold in [(n, w, s) in _ROW_DEEP]  # the deep tiles are the folded ones
    ]


def _tile_width(k: int, group: int, bits: int) -> int:
    """The widest tile (stored columns) that divides a row and lies within a scale's group."""
    stored = k // 2 if bits == 4 else k
    span = stored if group >= k else group  # columns one scale covers
    return next(w for w in _WIDTHS if span % w == 0)


def _candidates(configs, args: dict) -> list:
    """The configs to try for one product (see `_ROW_WIDE`): tiles that divide a row and, where
    scales are grouped, lie within a group; x as a vector and as a tile (`_input`; a gated
    input only as a vector: as a tile, every row of a program would recompute its SiLU).
    On an H200 (2026-12-02) the autotuner chose x as a tile for 12 of the 24 products it
    tuned in benchmarks/gemv.py (1B and 3B; bf16, int8, int4) and as a vector for 12: both
    stay. int8 of one scale a row, also biased (`INT8_BIASED`)."""
    k, group = args["K"], args["GROUP"]
    biased = {False, int8_biased(args["BITS"], group, k, args["x_ptr"].dtype, args["w_ptr"].dtype)}
    width = _tile_width(k, group, args["BITS"])
    if group < k:
        chosen = {(width, *shape) for shape in _GROUPED}
    else:
        wide, half = _ROW_WIDE, _ROW_HALF
        if args["NORM"] or args["GATED"]:
            wide, half = wide + _FUSED_WIDE, half + _FUSED_HALF
        chosen = {(width, *shape) for shape in wide} | {(width // 2, *shape) for shape in half}
    if FOLD and args["BITS"] == 8 and group >= k:  # (folded: see `_ROW_DEEP`)
        chosen |= {(width, *shape) for shape in _ROW_DEEP}
    stored = k // 2 if args["BITS"] == 4 else k
    return [
        c
        for c in configs
        if (c.kwargs["BLOCK_K"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) in chosen
        and not (c.kwargs["X_TILE"] and args["GATED"])
        and c.kwargs["INT8_BIASED"] in biased
        and _splits_fit(c.kwargs["SPLITS"], stored, c.kwargs["BLOCK_K"], args)
    ]


def _splits_fit(splits: int, length: int, step: int, args: dict) -> bool:
    """Whether a row of `length` (columns, or int4 groups) shares among `splits` programs that
    each take whole steps of `step`, within the product's MAX_SPLITS."""
    return splits <= args.get("MAX_SPLITS", 1) and length % (splits * step) == 0


def _max_splits(norm, swiglu: bool) -> int:
    """The most programs a product's rows may be split among: a norm needs all of a row's x
    in each program (its sum of squares), and SiLU·up both halves of the output."""
    return max(SPLIT_COUNTS) if SPLIT_K and norm is None and not swiglu else 1


# Tiles picked inside the decode step (benchmarks/tile_search.py), by GPU name and product. The
# autotuner times each tile alone, L2 flushed, while in the step the kernels launch early and
# overlap: on an H200 its picks ran the 1B's int8 up to 25% slower than others (session 16,
# docs/benchmarks.md). A product found here runs its tile untuned; LMFORGE_GEMV_TILES names
# another table, or `none` to tune every product.
TILES = Path(__file__).parents[1] / "gemv_tiles.json"  # (lmforge/generate/, as always)


def tile_key(args: dict) -> str:
    """A product's name in the table: `N K bits group` and its fusions (bits `4h`: int4 in
    packed fp16, `_gemv_int4`; `8f`: float8 e4m3)."""
    names = ("NORM", "GATED", "RESIDUAL", "SWIGLU")
    fusions = [name.lower() for name in names if args.get(name)]
    bits = args.get("BITS", "4h")
    if bits == 8 and args["w_ptr"].dtype.is_floating_point:
        bits = "8f"  # float8 e4m3
    return " ".join(str(v) for v in (args["N"], args["K"], bits, args["GROUP"], *fusions))


def describe(config) -> str:
    """A tile in the table: `BLOCK_NxBLOCK_K vec|tile wWARPS sSTAGES[ biased][ fold][ kSPLITS]`."""
    kwargs = config.kwargs
    split = f" k{kwargs['SPLITS']}" if kwargs.get("SPLITS", 1) > 1 else ""
    if "GROUPS" in kwargs:  # `_gemv_int4`: `BLOCK_NxGROUPSg wWARPS sSTAGES[ kSPLITS]`
        shape = f"{kwargs['BLOCK_N']}x{kwargs['GROUPS']}g"
        return f"{shape} w{config.num_warps} s{config.num_stages}{split}"
    x = "tile" if kwargs["X_TILE"] else "vec"
    tile = f"{kwargs['BLOCK_N']}x{kwargs['BLOCK_K']} {x} w{config.num_warps} s{config.num_stages}"
    fold = " fold" if kwargs.get("FOLD") else ""
    return tile + (" biased" if kwargs["INT8_BIASED"] else "") + fold + split


@cache
def pinned_tiles(gpu: str) -> dict[str, str]:
    """The table's tiles for the GPU named `gpu` ({} where it has none, or where the table
    cannot be read: then every product is tuned, with a warning)."""
    path = os.environ.get("LMFORGE_GEMV_TILES") or str(TILES)
    if path == "none":
        return {}
    try:
        pins = json.loads(Path(path).read_text()).get(gpu, {})
        if not all(isinstance(v, str) for v in pins.values()):
            raise ValueError("each product's tile must be a string, as `describe` writes it")
        return pins
    except (OSError, ValueError, AttributeError) as e:
        log.warning("LMFORGE_GEMV_TILES=%s: %s; tuning every product instead", path, e)
        return {}


@cache
def gpu_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def _fits(configs, named_args, **kwargs):
    """The autotuner's configs for one product: its pinned tile, or `_candidates`."""
    args = {**named_args, **kwargs}
    return _pinned(_candidates(configs, args), args)


def _pinned(candidates: list, args: dict) -> list:
    """The candidate that is the product's pinned tile, or all of them where none is pinned."""
    pin = pinned_tiles(gpu_name(args["w_ptr"].device)).get(tile_key(args))
    return [c for c in candidates if describe(c) == pin] or candidates


# Threads that compile a product's candidate tiles before the tuner times them (1: each compiles
# as it is first timed, Triton's own way). A product without a pinned tile on this GPU is tuned
# on its first call: the 8B's int8 products, 390 candidates in all, took 290.7 s of its first
# `lmforge generate` on an H200 (2026-12-05, docs/benchmarks.md). Compiling the 8B's 60 int8
# wqkv candidates for sm_90 through this tuner without a GPU (Triton 3.6, as the test
# `test_the_tuner_compiles_for_a_gpu_on_threads` does) took 24.0 s on one CPU core and 14.5 s
# on two threads: Triton's compiler leaves the GIL.
COMPILE_THREADS = min(16, os.cpu_count() or 1)


class _Tuner(Autotuner):
    """triton.autotune's tuner that, before timing a product's candidates, compiles them all on
    COMPILE_THREADS threads (Triton's async compile mode). A candidate that fails there is
    compiled again, and skipped, as it is timed; picks found in the cache compile nothing."""

    _launch: tuple | None = None  # the call being tuned: (args, kwargs)

    def run(self, *args, **kwargs):
        self._launch = (args, kwargs)
        try:
            return super().run(*args, **kwargs)
        finally:
            self._launch = None

    def check_disk_cache(self, tuning_key, configs, bench_fn):
        def compile_then_time():
            self.compile_all(configs)
            bench_fn()

        return super().check_disk_cache(tuning_key, configs, compile_then_time)

    def compile_all(self, configs: list) -> None:
        if COMPILE_THREADS < 2 or len(configs) < 2 or self._launch is None:
            return
        args, kwargs = self._launch
        try:
            with (
                ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="lmforge-tiles") as pool,
                triton.AsyncCompileMode(pool, ignore_errors=True),
            ):
                for config in configs:
                    self.fn.run(*args, **{**kwargs, **config.all_kwargs(), "warmup": True})
        except Exception as err:  # (an older Triton, or a compile mode already active)
            log.warning("compiling %d tiles on threads failed (%s): they compile one by one "
                        "as they are timed", len(configs), err)  # fmt: skip


def autotune(configs: list, key: list[str], prune):
    """`triton.autotune(configs, key, early_config_prune=prune, cache_results=True)` with the
    candidates compiled on threads (`_Tuner`). The picks are kept in Triton's cache directory
    (~/.triton/cache, TRITON_CACHE_DIR) for this GPU and kernel source: a later process starts
    without tuning and runs the same tiles (delete the directory to tune again)."""

    def decorator(fn):
        options = {"prune_configs_by": {"early_config_prune": prune}, "cache_results": True}
        try:  # (Triton 3.6-3.9's Autotuner; another may take other arguments: then its own)
            return _Tuner(fn, fn.arg_names, configs, key, None, None, **options)
        except TypeError:
            return triton.autotune(configs, key, **options)(fn)

    return decorator


INTERPRETED_X_TILE = True  # x as a tile where it may be (tests set False for the vector path)
INTERPRETED_SPLITS = 1  # programs a row is split among where it may be (tests set 2)
INTERPRETED_FOLD = False  # int8 of one scale a row folded (`_fold`; tests set True)


def _interpreted_splits(length: int, step: int, max_splits: int) -> int:
    """The interpreter's split count (`INTERPRETED_SPLITS` where the product takes it)."""
    fits = _splits_fit(INTERPRETED_SPLITS, length, step, {"MAX_SPLITS": max_splits})
    return INTERPRETED_SPLITS if fits else 1


def _interpreted_tiles(k, group, bits, gated, dtype, weights, max_splits) -> dict:
    """The one configuration the interpreter runs: wide tiles (it runs programs in turn)."""
    x_tile = INTERPRETED_X_TILE and not gated
    biased = int8_biased(bits, group, k, dtype, weights)
    stored = k // 2 if bits == 4 else k
    splits = _interpreted_splits(stored, MIN_TILE, max_splits)
    share = next(w for w in _WIDTHS if (stored // splits) % w == 0)  # the widest that divides it
    width = min(_tile_width(k, group, bits), share)
    tiles = {"BLOCK_N": 32, "BLOCK_K": width, "X_TILE": x_tile, "INT8_BIASED": biased}
    fold = INTERPRETED_FOLD and FOLD and bits == 8 and group >= k
    return tiles | {"SPLITS": splits, "FOLD": fold}


# (BLOCK_N, GROUPS, num_warps, num_stages) `_gemv_int4` tries; GROUPS must divide a row's groups
# of low nibbles. A thread reads 16 bytes of a row at a time (4 words), and holds BLOCK_N /
# num_warps rows where GROUPS x group / 128 threads span a row: x is made once for those rows.
_INT4_TILES = [
    (4, 4, 1, 1), (8, 4, 2, 1), (16, 4, 4, 1), (16, 4, 4, 3), (32, 4, 4, 1), (8, 2, 2, 1),
    (16, 2, 4, 3), (8, 8, 2, 1), (16, 8, 4, 1), (8, 1, 1, 1), (16, 1, 2, 3),
]  # fmt: skip


def _int4_configs() -> list[triton.Config]:
    return [
        triton.Config({"BLOCK_N": n, "GROUPS": g, "SPLITS": k}, num_warps=w, num_stages=st)
        for n, g, w, st in _INT4_TILES
        for k in SPLIT_COUNTS
    ]


def _int4_candidates(configs, args: dict) -> list:
    """The configs to try for one int4 product: those whose groups divide a row's (or its
    share of a row, split)."""
    halves = args["K"] // 2 // args["GROUP"]
    return [c for c in configs if _splits_fit(c.kwargs["SPLITS"], halves, c.kwargs["GROUPS"], args)]


def _int4_fits(configs, named_args, **kwargs):
    """The autotuner's configs for one int4 product (its arguments by name, as it passes them:
    positional ones in `named_args`, the rest in `kwargs`): its pinned tile, or the candidates."""
    args = {**named_args, **kwargs}
    return _pinned(_int4_candidates(configs, args), args)
