"""Arguments several subcommands share: where a model runs and in which precision, and
`--config FILE` for the commands that pipeline stages run; and the decode step's warm-up that
generate and serve print."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping
from pathlib import Path

from lmforge.config import Section, load_config
from lmforge.errors import ConfigError


def add_runtime_arguments(
    parser: argparse.ArgumentParser, *, compile_help: str | None = None
) -> None:
    """--device and --dtype (and --compile/--no-compile when `compile_help` is given)."""
    parser.add_argument("--device", default="auto", help="auto (default), cpu, cuda or cuda:N")
    parser.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        default=None,
        help="compute dtype (default: as stored)",
    )
    if compile_help is not None:
        parser.add_argument(
            "--compile", action=argparse.BooleanOptionalAction, default=None, help=compile_help
        )


def add_overwrite_argument(parser: argparse.ArgumentParser) -> None:
    """--overwrite: the one way to replace an existing artifact at OUT."""
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace OUT when it is an lmforge artifact already (OUT must otherwise be new or "
        "empty: a directory with other files is never written into)",
    )


def add_config_file(parser: argparse.ArgumentParser, keys: Mapping[str, str], *, what: str) -> None:
    """`--config FILE`: the settings `keys` ({dest: how the command line spells it}) from a TOML
    or YAML file instead of the command line; what a pipeline stage runs (`lmforge COMMAND
    --config stage.toml`). Call it after adding the arguments that `keys` name."""
    parser.add_argument(
        "--config",
        type=Path,
        metavar="FILE",
        help=f"read {what} from a TOML or YAML file (keys: {', '.join(keys)}) instead of the "
        "command line",
    )
    parser.set_defaults(
        config_keys={key: (parser.get_default(key), spelled) for key, spelled in keys.items()}
    )


def apply_config_file(args: argparse.Namespace, schema: type[Section]) -> None:
    """With --config FILE: validate FILE against `schema` and set its settings on `args` (a
    list left empty in FILE counts as not given). A setting given on the command line as well
    is refused: one run reads its settings from one place."""
    if args.config is None:
        return
    given = [
        spelled
        for key, (default, spelled) in args.config_keys.items()
        if getattr(args, key) != default
    ]
    if given:
        raise ConfigError(
            f"--config {args.config} gives the settings; do not also give {', '.join(given)}"
        )
    cfg = load_config(schema, args.config)
    for key, (default, _) in args.config_keys.items():
        value = getattr(cfg, key)
        setattr(args, key, default if value in (None, []) else value)


def require_arguments(args: argparse.Namespace, names: Mapping[str, str]) -> None:
    """Refuse a run without the arguments `names` ({dest: how the command line spells it})
    that the command line may leave out only when --config gives them."""
    missing = [name for key, name in names.items() if getattr(args, key) in (None, [])]
    if missing:
        raise ConfigError(
            f"the following arguments are required: {', '.join(missing)} (or --config FILE)"
        )


def warm_up(generator) -> None:
    """Compile (and on a GPU tune) `generator`'s decode step before the first request, saying
    so: a model's first run on a GPU tunes its kernels, minutes for a large quantized one."""
    if not generator.compiled:
        return
    tunes = " and tuning its kernels (kept in Triton's cache for later runs)"
    what = "compiling the decode step" + (tunes if generator.device.type == "cuda" else "")
    print(f"{what}...", file=sys.stderr, flush=True)
    print(f"compiled in {generator.warmup():.1f}s", file=sys.stderr)
