"""`lmforge merge ADAPTER BASE OUT`: fold a LoRA adapter into its base model's weights."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from lmforge.commands.common import add_overwrite_argument


def register(subparsers) -> None:
    merge = subparsers.add_parser(
        "merge",
        help="merge a LoRA adapter into its base model",
        description="Load BASE (a preset, HF directory, artifact, Meta download), apply the "
        "PEFT-format LoRA adapter in ADAPTER (adapter_config.json + adapter_model.safetensors, "
        "ours or the peft library's), fold it into the weights and write a full artifact with "
        "lineage (stage 'merge', parent BASE).",
    )
    merge.add_argument("adapter", type=Path, metavar="ADAPTER", help="adapter directory")
    merge.add_argument("base", metavar="BASE", help="the model the adapter was trained on")
    merge.add_argument("out", type=Path, metavar="OUT", help="artifact directory to write")
    merge.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        default=None,
        help="dtype of the written weights (default: the base's stored dtype)",
    )
    add_overwrite_argument(merge)
    merge.set_defaults(func=merge_main)


def merge_main(args: argparse.Namespace) -> int:
    import lmforge
    from lmforge.artifact import check_output
    from lmforge.modules import lora

    start = time.perf_counter()
    check_output(args.out, inputs=[args.adapter, args.base], overwrite=args.overwrite)
    adapter_cfg = lora.read_peft_config(args.adapter)  # fail on a bad adapter before loading
    loaded = lmforge.load(args.base)
    lora.load_peft_adapter(loaded.model, args.adapter)
    lora.merge_lora(loaded.model)  # merged in fp32, stored back in the base's dtype
    config = {
        "adapter": str(args.adapter),
        "adapter_hash": lora.adapter_hash(args.adapter),
        "lora": adapter_cfg.model_dump(exclude={"enabled", "quantize_base"}),
    }
    out = lmforge.save(
        loaded,
        args.out,
        dtype=args.dtype,
        stage="merge",
        parent=args.base,
        config=config,
        overwrite=args.overwrite,
    )
    print(
        f"merged {args.adapter} (rank {adapter_cfg.rank}, targets "
        f"{', '.join(adapter_cfg.targets)}) into {args.base}: wrote {out} in "
        f"{time.perf_counter() - start:.1f}s"
    )
    return 0
