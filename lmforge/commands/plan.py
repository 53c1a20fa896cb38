"""`lmforge plan`: will a training job (or, with --task, an inference stage) fit on these GPUs,
and what is the smallest setup that does."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from lmforge.errors import ConfigError
from lmforge.quantize.schemes import SCHEMES

JOBS = ("pretrain", "sft", "dpo", "grpo")
# --method grpo[-lora|-qlora]: GRPO on the trainer's method of that name
GRPO_METHODS = {"grpo": "full", "grpo-lora": "lora", "grpo-qlora": "qlora"}
EPILOG = """\
examples:
  lmforge plan --model llama3.1-70b --method full --gpus 2x8 --gpu-memory h100 --ac full --cpu-offload
  lmforge plan --model llama3.1-70b --method lora --lora-targets q,k,v --gpus 8 --gpu-memory 80GB
  lmforge plan --model llama3.1-8b --method full --gpu-memory 80GB --micro-batch-size 4 --search
  lmforge plan --config sft.toml --gpus 4 --gpu-memory h100 --dry-run
  lmforge plan --model llama3.2-1b --method grpo --generations 8 --prompts 64 --seq-len 1024
  lmforge plan --model llama3.1-70b --task generate --tp 8 --batch 16 --seq-len 8192
  lmforge plan --model llama3.1-8b --task eval --quantization int4-wo --gpu-memory 24GB

Inference (--task): generate (`lmforge generate` and the server: weights, a KV cache of --batch
rows × --seq-len slots, a prefill chunk or a decode step), score (lm-eval's log-likelihoods:
one forward of --batch rows × --seq-len tokens), eval (both), quantize (streaming, one tensor
at a time); --tp N is `lmforge launch --nproc N`.

GPU memory: 80GB / 80GiB (both 2^30 bytes: GPU memory is quoted in binary units), 85e9 (bytes),
or a GPU name (h100, h200, a100-40gb, a100-80gb, l40s, b200). Exit status: 0 fits, 1 does not
fit, 2 bad arguments.
"""


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "plan",
        help="per-GPU memory of a training job or an inference stage: fits or not, and what "
        "to change",
        description="Per-GPU memory of one training step as lmforge's trainer runs it "
        "(parameters, gradients, optimizer states, FSDP buffers, activations, logits, "
        "overhead), a FITS / DOES NOT FIT verdict, suggestions ranked by cost, the fewest GPUs "
        "that fit (--search), and a check of the sharding against the real parallelize() on a "
        "fake process group (--dry-run); with --task, the same for an inference stage (weights "
        "per GPU under tensor parallelism, KV cache, prefill, decode and scoring activations).",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    what = parser.add_argument_group("model and method")
    what.add_argument("--model", help="preset name or model directory (HF / artifact / Meta)")
    what.add_argument(
        "--method",
        choices=["pretrain", "full", "lora", "qlora", "dpo-lora", "dpo-full", *GRPO_METHODS],
    )
    what.add_argument("--lora-rank", type=int)
    what.add_argument("--lora-targets", help="comma-separated: q,k,v,o,gate,up,down,output")
    what.add_argument("--dpo-reference", choices=["auto", "adapters_disabled", "frozen_copy"])
    what.add_argument("--generations", type=int, help="GRPO: completions per prompt (default 8)")
    what.add_argument("--prompts", type=int, help="GRPO: prompts per rollout batch (default 8)")
    what.add_argument(
        "--rollout-batch", type=int, help="GRPO: engine KV-cache rows (default: all sequences)"
    )
    what.add_argument(
        "--max-new-tokens",
        type=int,
        help="GRPO: tokens a completion (default 256; the positions its logits cover)",
    )
    what.add_argument(
        "--kl-reference",
        choices=["none", "auto", "adapters_disabled", "frozen_copy"],
        help="GRPO: the KL term's reference (default none: grpo.beta = 0)",
    )
    what.add_argument(
        "--config", type=Path, help="a pretrain / sft / dpo / grpo job config (TOML/YAML)"
    )
    what.add_argument("--job", choices=JOBS, help="which job --config is (default: guessed)")
    inference = parser.add_argument_group("inference (instead of a training job)")
    # (the planner checks --task: importing its list here would load torch for every --help)
    inference.add_argument("--task", help="plan this inference stage (see below)")
    inference.add_argument(
        "--batch",
        type=int,
        help="KV-cache rows (generate: --max-batch / --max-concurrency) or rows of one forward "
        "(score: eval's --batch-size); default 8, as those commands",
    )
    inference.add_argument(
        "--scored-tokens",
        type=int,
        help="score/eval: positions a row scores through the output projection (default 256: "
        "lm-eval's continuations are short; perplexity scores all --seq-len)",
    )
    inference.add_argument("--quantization", choices=SCHEMES, help="a quantized artifact")
    inference.add_argument(
        "--prefill-chunk", type=int, help="prompt tokens prefilled per step (default 2048)"
    )
    hardware = parser.add_argument_group("hardware and layout")
    hardware.add_argument("--gpus", default=None, help="total GPUs, or NODESxGPUS (2x8); default 1")
    hardware.add_argument("--nodes", type=int, help="spread --gpus over this many nodes")
    hardware.add_argument("--gpus-per-node", type=int, default=None, help="default 8")
    hardware.add_argument("--gpu-memory", default="80GB", help="per GPU (default 80GB)")
    hardware.add_argument("--host-memory", default=None, help="per node (default 256GiB per GPU)")
    hardware.add_argument("--dp-shard", type=int)
    hardware.add_argument("--dp-replicate", type=int)
    hardware.add_argument("--tp", type=int)
    hardware.add_argument(
        "--ep", type=int, help="expert parallelism (MoE): experts split over ep of the dp ranks"
    )
    hardware.add_argument(
        "--ac", choices=["none", "selective", "full"], help="activation checkpointing"
    )
    hardware.add_argument("--cpu-offload", action="store_true", default=None)
    hardware.add_argument("--compile", action="store_true", default=None)
    step = parser.add_argument_group("step and precision")
    step.add_argument("--micro-batch-size", type=int)
    step.add_argument(
        "--seq-len", type=int, help="tokens per sequence (--task: KV-cache slots per row)"
    )
    step.add_argument("--grad-accumulation", type=int)
    step.add_argument("--optimizer", choices=["adamw", "sgd"])
    step.add_argument("--param-dtype", choices=["fp32", "bf16"])
    step.add_argument("--grad-dtype", choices=["fp32", "bf16"])
    step.add_argument("--optimizer-dtype", choices=["fp32", "bf16"])
    step.add_argument("--compute-dtype", choices=["bf16", "fp32"])
    actions = parser.add_argument_group("actions")
    actions.add_argument("--search", action="store_true", help="find the fewest GPUs that fit")
    actions.add_argument(
        "--dry-run",
        action="store_true",
        help="apply the real parallelize() on the meta device over a fake process group and "
        "compare the sharded sizes with the arithmetic",
    )
    parser.set_defaults(func=plan_main)


def parse_gpus(text: str | None, nodes: int | None, per_node: int | None) -> tuple[int, int]:
    """(total GPUs, GPUs per node) from --gpus N | NxM, --nodes, --gpus-per-node."""
    per_node_default = per_node or 8
    if text is None:
        total = 1
    else:
        match = re.fullmatch(r"\s*(\d+)\s*(?:[x×*]\s*(\d+))?\s*", str(text))
        if not match or int(match.group(1)) < 1 or (match.group(2) and int(match.group(2)) < 1):
            raise ConfigError(f"--gpus {text!r}: expected a count (16) or NODESxGPUS (2x8)")
        if match.group(2):
            if nodes is not None and nodes != int(match.group(1)):
                raise ConfigError(f"--gpus {text} and --nodes {nodes} disagree")
            count, per = int(match.group(1)), int(match.group(2))
            return count * per, per
        total = int(match.group(1))
    if nodes is not None:
        if nodes < 1 or total % nodes:
            raise ConfigError(f"--nodes {nodes} must divide --gpus {total}")
        return total, total // nodes
    return total, per_node_default


def guess_job(path: Path) -> str:
    """pretrain / sft / dpo / grpo from a job config's sections."""
    import tomllib

    import yaml

    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        text = path.read_text()
        data = tomllib.loads(text) if path.suffix == ".toml" else yaml.safe_load(text)
    except (tomllib.TOMLDecodeError, yaml.YAMLError, UnicodeDecodeError) as err:
        raise ConfigError(f"{path}: cannot parse ({err})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a table of sections at the top level")
    sections = set(data)
    data_keys = set(data.get("data") or {})
    if "dpo" in sections:
        return "dpo"
    if "grpo" in sections:
        return "grpo"
    if "lora" in sections or data_keys & {"path", "dataset", "max_seq_len", "format", "packing"}:
        return "sft"
    if data_keys & {"shards", "seq_len", "document_masking"}:
        return "pretrain"
    raise ConfigError(f"{path}: cannot tell which job this is; pass --job {'|'.join(JOBS)}")


def build_setup(args: argparse.Namespace):
    from lmforge import api
    from lmforge.plan.memory import Setup

    total, per_node = parse_gpus(args.gpus, args.nodes, args.gpus_per_node)
    if args.config is not None:
        from lmforge.config import load_config
        from lmforge.plan.memory import setup_from_job
        from lmforge.train.config import DPOJob, GRPOJob, PretrainJob, SFTJob

        kind = args.job or guess_job(args.config)
        schema = {"pretrain": PretrainJob, "sft": SFTJob, "dpo": DPOJob, "grpo": GRPOJob}[kind]
        job = load_config(schema, args.config)
        if args.model:
            job.model.source = args.model
        setup = setup_from_job(job, gpus=total, gpus_per_node=per_node)
    else:
        if not args.model:
            raise ConfigError("name the model: --model PRESET|DIR (or --config JOB.toml)")
        source = args.model
        setup = Setup(
            args=api.read_args(source),
            model_name=source,
            method="full",
            gpus=total,
            gpus_per_node=per_node,
            reshard_after_forward="auto",  # the trainer's default (resolved in plan_main)
            from_scratch=api.detect_format(source) == "preset",
        )
    method, grpo = args.method, {}
    if method in GRPO_METHODS:
        method = GRPO_METHODS[method]
        grpo = {"grpo_generations": 8, "grpo_reference": "none"}
    if grpo or setup.is_grpo:
        grpo.update(
            (key, value)
            for key, value in (
                ("grpo_generations", args.generations),
                ("grpo_prompts", args.prompts),
                ("grpo_rollout_batch", args.rollout_batch),
                ("grpo_new_tokens", args.max_new_tokens),
                ("grpo_reference", args.kl_reference),
            )
            if value is not None
        )
    else:
        _refuse_flags(args, GRPO_ONLY, "only with --method grpo[-lora|-qlora] or a grpo --config")
    changes = {
        **grpo,
        "method": method,
        "lora_rank": args.lora_rank,
        "dpo_reference": args.dpo_reference,
        "dp_shard": args.dp_shard,
        "dp_replicate": args.dp_replicate,
        "tp": args.tp,
        "ep": args.ep,
        "activation_checkpointing": args.ac,
        "cpu_offload": args.cpu_offload,
        "compile": args.compile,
        "micro_batch_size": args.micro_batch_size,
        "seq_len": args.seq_len,
        "grad_accumulation": args.grad_accumulation,
        "optimizer": args.optimizer,
        "param_dtype": args.param_dtype,
        "grad_dtype": args.grad_dtype,
        "optimizer_dtype": args.optimizer_dtype,
        "compute_dtype": args.compute_dtype,
    }
    if args.config is None and args.method != "pretrain":
        # finetuning a preset's shape means its released checkpoint (bf16 as stored), not
        # the random fp32 model a preset starts pretraining from
        changes["from_scratch"] = False
    if args.lora_targets:
        changes["lora_targets"] = tuple(
            t.strip() for t in args.lora_targets.split(",") if t.strip()
        )
    setup = setup.replace(**{k: v for k, v in changes.items() if v is not None})
    if setup.is_grpo and args.config is None and args.grad_accumulation is None:
        # a GRPO step trains on the whole rollout batch (lmforge.train.config.GRPOJob)
        sequences = setup.grpo_prompts * setup.grpo_generations
        per_pass = setup.micro_batch_size * setup.dp_size
        setup = setup.replace(grad_accumulation=max(1, -(-sequences // per_pass)))
    fixed = {
        name
        for name, value in (
            ("tp", args.tp),
            ("ac", args.ac),
            ("cpu_offload", args.cpu_offload),
            ("dp_replicate", args.dp_replicate),
        )
        if value is not None
    }
    return setup, fixed


GRPO_ONLY = ("generations", "prompts", "rollout_batch", "max_new_tokens", "kl_reference")
TRAINING_ONLY = (
    "method", "lora_rank", "lora_targets", "dpo_reference", *GRPO_ONLY, "config", "job",
    "dp_shard", "ep",
    "dp_replicate", "ac", "cpu_offload", "compile", "micro_batch_size", "grad_accumulation",
    "optimizer", "param_dtype", "grad_dtype", "optimizer_dtype", "search", "dry_run", "nodes",
    "gpus", "gpus_per_node", "host_memory",
)  # fmt: skip
INFERENCE_ONLY = ("batch", "quantization", "prefill_chunk", "scored_tokens")


def _refuse_flags(args: argparse.Namespace, names: tuple[str, ...], why: str) -> None:
    """ConfigError naming the flags among `names` that were given (0 counts; an unset switch
    is None or False)."""
    given = [n for n in names if getattr(args, n) is not None and getattr(args, n) is not False]
    if given:
        flags = ", ".join("--" + name.replace("_", "-") for name in given)
        hint = " (an inference stage's GPUs are its --tp)" if "gpus" in given else ""
        raise ConfigError(f"{flags}: {why}{hint}")


def _given(args: argparse.Namespace, name: str, default):
    """The flag's value when it was given (0 too, for the planner to refuse), else `default`."""
    value = getattr(args, name)
    return default if value is None else value


def plan_inference_main(args: argparse.Namespace) -> int:
    """`lmforge plan --task ...`: the inference planner's table, verdict and suggestions."""
    from lmforge import api
    from lmforge.plan.inference import (
        DEFAULT_PREFILL_CHUNK,
        EVAL_SCORED_TOKENS,
        InferenceSetup,
        format_inference_plan,
        plan_inference,
        suggest_inference,
    )
    from lmforge.quantize.stored import has_mxfp4_experts

    _refuse_flags(args, TRAINING_ONLY, "only without --task (a training plan)")
    if not args.model:
        raise ConfigError("name the model: --model PRESET|DIR")
    model_args = api.read_args(args.model)
    defaults = {
        "tp": 1,
        "batch": 8,  # lmforge generate --max-batch, serve --max-concurrency, eval --batch-size
        "seq_len": min(model_args.max_seq_len, 4096),
        "prefill_chunk": DEFAULT_PREFILL_CHUNK,
    }
    sizes = {key: _given(args, key, default) for key, default in defaults.items()}
    scored = _given(args, "scored_tokens", min(EVAL_SCORED_TOKENS, sizes["seq_len"]))
    setup = InferenceSetup(
        args=model_args,
        task=args.task,
        dtype=args.compute_dtype or "bf16",
        quantization=args.quantization,
        mxfp4_experts=has_mxfp4_experts(Path(args.model)),
        scored_tokens=scored if args.task in ("score", "eval") else None,
        **sizes,
    )
    plan = plan_inference(setup, args.gpu_memory)
    if plan.fits is False:
        command = {"score": "eval", "eval": "eval"}.get(args.task, "generate")
        plan.suggestions = suggest_inference(setup, args.gpu_memory, command=command)
    print(format_inference_plan(plan))
    return 0 if plan.fits else 1


def plan_main(args: argparse.Namespace) -> int:
    if args.task is not None:
        return plan_inference_main(args)
    _refuse_flags(args, INFERENCE_ONLY, "only with --task (an inference plan)")
    from lmforge.plan import dry_run, format_plan, format_suggestions, plan_memory, search, suggest
    from lmforge.plan.memory import GiB, parse_memory
    from lmforge.plan.search import resolve_reshard_after_forward

    setup, fixed = build_setup(args)
    gpu_memory = parse_memory(args.gpu_memory)
    # parallel.reshard_after_forward = "auto" decided as the trainer decides it on this GPU.
    setup = setup.replace(reshard_after_forward=resolve_reshard_after_forward(setup, gpu_memory))
    host_memory = parse_memory(args.host_memory) if args.host_memory else None
    plan = plan_memory(setup, gpu_memory, host_memory=host_memory)
    print(format_plan(plan))
    print()
    if args.search:
        result = search(setup, gpu_memory, host_memory=host_memory, fixed=fixed)
        if result.plan is None:
            print(
                f"search: nothing fits on up to {result.gpus} GPUs of {gpu_memory / GiB:.0f} GiB "
                f"({result.tried} setups tried); activations and logits do not shrink with "
                "more FSDP GPUs: lower --micro-batch-size / --seq-len, or use --ac full"
            )
        else:
            found = result.plan.setup
            replicate, shard, tp = found.mesh
            print(
                f"search: fewest GPUs of {gpu_memory / GiB:.0f} GiB that fit: {result.gpus} "
                f"(dp_replicate {replicate} × dp_shard {shard} × tp {tp}, activation "
                f"checkpointing {found.activation_checkpointing}"
                + (", CPU offload" if found.cpu_offload else "")
                + f"; {result.tried} setups tried)"
            )
            print()
            print(format_plan(result.plan))
        print()
    if plan.fits is False or (plan.fits and not args.search):
        items = suggest(plan)
        if plan.fits:
            items = [item for item in items if item.cost < 1]  # only what is cheaper
            if items:
                print(
                    format_suggestions(items).replace("suggestions", "cheaper setups that fit", 1)
                )
                print()
        else:
            print(format_suggestions(items))
            print()
    if args.dry_run:
        report = dry_run(setup)
        print(report.table())
        if not report.matches:
            print("dry run and arithmetic DISAGREE: please report this (lmforge plan --dry-run)")
    return 0 if plan.fits else 1
