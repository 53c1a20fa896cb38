"""Helpers for training tests: a tiny corpus, tokenizer and shards; running lmforge commands."""

from __future__ import annotations

import contextlib
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from lmforge.cli import main as cli_main
from lmforge.data.demo import write_demo_data
from lmforge.data.tokenizer import Tokenizer, train_bpe
from lmforge.models import ModelArgs, get_preset

# A model small enough that a training step takes milliseconds on one CPU core.
SMALL_SHAPE = dict(dim=64, num_layers=2, num_heads=4, num_kv_heads=2, ffn_dim=128)
SMALL_MODEL = ["model.source=tiny", *(f"model.overrides.{k}={v}" for k, v in SMALL_SHAPE.items())]


# The same shape as a Qwen3 (tied, as the small Qwen3 presets are), with a head_dim of its own.
QWEN3_MODEL = [
    "model.source=qwen3-0.6b",
    "model.overrides.head_dim=24",
    "model.overrides.vocab_size=320",
]


def small_args(vocab_size: int = 256, **changes) -> ModelArgs:
    """The tiny preset cut down to SMALL_SHAPE."""
    return get_preset("tiny").replace(**{**SMALL_SHAPE, "vocab_size": vocab_size, **changes})


def small_qwen3_args(vocab_size: int = 256, **changes) -> ModelArgs:
    """Qwen3 0.6B cut down to SMALL_SHAPE with head_dim 24 (not dim / heads); tied."""
    shape = {**SMALL_SHAPE, "head_dim": 24, "vocab_size": vocab_size, "bos_id": None}
    return get_preset("qwen3-0.6b").replace(**{**shape, "eos_id": None, **changes})


# Qwen3-MoE cut down the same way: every block sparse, 4 experts of width 32, top-2.
SMALL_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_ffn_dim=32)
QWEN3_MOE_MODEL = [
    "model.source=qwen3-30b-a3b",
    *(f"model.overrides.{k}={v}" for k, v in {**SMALL_SHAPE, **SMALL_MOE}.items()),
    "model.overrides.head_dim=24",
]


def small_qwen3_moe_args(vocab_size: int = 256, **changes) -> ModelArgs:
    """Qwen3-30B-A3B cut down to SMALL_SHAPE and SMALL_MOE with head_dim 24; untied."""
    shape = {**SMALL_SHAPE, **SMALL_MOE, "head_dim": 24, "vocab_size": vocab_size}
    return get_preset("qwen3-30b-a3b").replace(
        **{**shape, "bos_id": None, "eos_id": None, **changes}
    )


def small_family_args(family: str, vocab_size: int = 256, **changes) -> ModelArgs:
    make = {"llama": small_args, "qwen3": small_qwen3_args, "qwen3_moe": small_qwen3_moe_args}
    return make[family](vocab_size, **changes)


def demo_world(root: Path, vocab_size: int) -> tuple[dict[str, Path], Tokenizer, ModelArgs]:
    """The demo data under root/data, a BPE tokenizer trained on its corpus (root/tokenizer) and
    the small shape for that tokenizer."""
    data = write_demo_data(root / "data")
    tokenizer = train_bpe([data["corpus"]], vocab_size=vocab_size, out_dir=root / "tokenizer")
    return data, tokenizer, small_args(tokenizer.vocab_size)


def write_corpus(path: Path, *, num_docs: int = 400, seed: int = 0) -> Path:
    rng = random.Random(seed)
    names = ["Ada", "Bo", "Cy", "Di", "Ed", "Flo", "Gus", "Hal"]
    things = ["apples", "boats", "clocks", "drums", "eggs", "flutes", "grapes", "hats"]
    with path.open("w") as handle:
        for _ in range(num_docs):
            name, thing = rng.choice(names), rng.choice(things)
            count = rng.randint(2, 9)
            handle.write(f"{name} likes {thing}. {name} keeps {count} {thing} at home.\n\n")
    return path


def make_shards(root: Path) -> tuple[Path, Path]:
    """(tokenizer_dir, shards_dir) for a small generated corpus."""
    from lmforge.data.prepare import PrepareSection, prepare
    from lmforge.data.tokenizer import train_bpe

    root.mkdir(parents=True, exist_ok=True)
    corpus = write_corpus(root / "corpus.txt")
    tokenizer_dir = root / "tokenizer"
    train_bpe([corpus], vocab_size=300, out_dir=tokenizer_dir)
    shards = root / "shards"
    prepare(
        PrepareSection(
            input=[str(corpus)],
            tokenizer=str(tokenizer_dir),
            out=str(shards),
            text_split="paragraph",
            workers=1,
        )
    )
    return tokenizer_dir, shards


def pretrain_args(run_dir: Path, tokenizer: Path, shards: Path, *extra: str) -> list[str]:
    return [
        f"run_dir={run_dir}",
        f"data.shards={shards}",
        f"model.tokenizer={tokenizer}",
        "data.seq_len=32",
        "train.micro_batch_size=4",
        "train.steps=5",
        "train.deterministic=true",
        "scheduler.warmup_steps=2",
        "optim.lr=1e-2",
        "metrics.log_every=1",
        "metrics.tensorboard=false",
        "checkpoint.every=0",
        *SMALL_MODEL,
        *extra,
    ]


def run_inprocess(command: str, args: list[str]) -> int:
    return cli_main([command, *args])


def torchrun(nproc: int, command: str, args: list[str], **popen) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "--signals-to-handle=SIGTERM,SIGINT,SIGUSR1,SIGUSR2",
        "-m",
        "lmforge",
        command,
        *args,
    ]
    return subprocess.Popen(cmd, env=env, **popen)


def run_torchrun(nproc: int, command: str, args: list[str], timeout: float = 300) -> None:
    """`lmforge COMMAND ARGS` on `nproc` processes to the end, as torchrun's workers: the
    environment torchrun gives them (ranks, world size, a free port of this host for the
    store), started here without torchrun's own process, whose start (importing torch) cost
    ~2.3 s of wall time a run, 40-odd runs in the suite. The tests of torchrun's part (signals
    it forwards, a SIGKILLed launcher) run it (`torchrun`). A failed worker stops the rest."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {
        **os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port), "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc),
        "GROUP_RANK": "0", "ROLE_WORLD_SIZE": str(nproc), "TORCHELASTIC_RUN_ID": "tests",
    }  # fmt: skip
    with contextlib.ExitStack() as files:
        logs = [files.enter_context(tempfile.TemporaryFile()) for _ in range(nproc)]
        workers = [
            subprocess.Popen(
                [sys.executable, "-m", "lmforge", command, *args],
                env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank), "ROLE_RANK": str(rank)},
                stdout=log,
                stderr=subprocess.STDOUT,
            )
            for rank, log in enumerate(logs)
        ]
        _wait_for_all(workers, timeout)
        out = ""
        for rank, log in enumerate(logs):
            log.seek(0)
            tail = log.read().decode(errors="replace")[-3000:]
            out += f"--- rank {rank} (exit {workers[rank].returncode})\n{tail}"
    assert all(w.returncode == 0 for w in workers), out


def _wait_for_all(workers: list[subprocess.Popen], timeout: float) -> None:
    """Until every worker exits, one fails (the others would wait in a collective: killed)
    or `timeout` seconds pass (all killed)."""
    deadline = time.monotonic() + timeout
    try:
        while any(w.poll() is None for w in workers) and time.monotonic() < deadline:
            if any(w.returncode not in (None, 0) for w in workers):
                break
            time.sleep(0.05)
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
            worker.wait()


def losses(run_dir: Path) -> dict[int, float]:
    """step -> loss from metrics.jsonl (the last record wins for a repeated step)."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records}


def descendants(pid: int) -> list[int]:
    """All processes below `pid` (torchrun starts its workers in sessions of their own, so a
    process-group kill would miss them)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def kill_all(proc: subprocess.Popen) -> None:
    """SIGKILL a launcher and every process under it, all at once."""
    import signal

    for pid in [proc.pid, *descendants(proc.pid)]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.wait()


def wait_for_step(run_dir: Path, step: int, proc: subprocess.Popen, timeout: float = 240) -> None:
    """Block until the run's metrics.jsonl has logged `step` (the process must still run)."""
    import time

    deadline = time.time() + timeout
    metrics = run_dir / "metrics.jsonl"
    while time.time() < deadline:
        assert proc.poll() is None, "training ended before it could be interrupted"
        if metrics.exists():
            lines = [line for line in metrics.read_text().splitlines() if line.strip()]
            if lines and max(json.loads(line)["step"] for line in lines) >= step:
                return
        time.sleep(0.02)
    raise TimeoutError(f"step {step} not reached in {timeout}s")
