"""EleutherAI lm-eval, run in process on lmforge models.

`LmforgeLM` is an `lm_eval.api.model.LM` over a model loaded with `lmforge.load` (full or
quantized artifact, HF directory, preset): batched `loglikelihood` (requests sorted by length,
longest first, right-padded; only the continuation positions go through the output projection),
`loglikelihood_rolling` (disjoint windows of the maximum length, each with the fullest context),
`generate_until` (through the inference engine, `lmforge.generate.Generator`; greedy or
sampled), and `apply_chat_template` so that `--chat` evaluates in the model's chat format.
Tokenization follows lm-eval's `hf` backend, so that scores equal it on the same artifact:
context and continuation are encoded together and split at the context's length, trailing
spaces of the context move to the continuation, BOS is prepended when the tokenizer adds it in
transformers (unless the text already starts with it), and special-token text (a rendered chat
template) becomes special ids.

`run_eval` evaluates tasks (lm-eval names or local YAMLs from include paths) on one or more
artifacts, writes a results JSON per artifact and returns the results; `format_results_table`
and `format_comparison_table` make the console tables (value ± standard error, and deltas).
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import json
import logging
import math
import os
import re
import subprocess
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from unittest import mock

import torch
from lm_eval.api.instance import Instance
from lm_eval.api.model import LM

from lmforge.api import LoadedModel, resolve_device
from lmforge.artifact import LINEAGE_NAME, artifact_hash, read_json
from lmforge.errors import ConfigError, DataError, ModelFormatError
from lmforge.generate import Generator, SamplingParams, parallel
from lmforge.generate.engine import use_quantized_kernels
from lmforge.generate.generate import peak_memory_bytes
from lmforge.generate.logprobs import (
    context_groups,
    sequence_logprobs,
    shared_context_logprobs,
)
from lmforge.progress import Progress

logger = logging.getLogger(__name__)

SAMPLING_KEYS = {"do_sample", "temperature", "top_k", "top_p"}


# ----------------------------------------------------------------------------------------------
# The LM adapter


class LmforgeLM(LM):
    """lm-eval's model interface over an lmforge model.

    Args:
        source: a model source for `lmforge.load` (artifact, HF directory, ...) or a
            `LoadedModel` (then `device` and `dtype` are those it already has).
        batch_size: sequences per forward pass.
        device: "cpu", "cuda", "cuda:N" or "auto".
        dtype: "float32", "bfloat16", "float16" or None (as stored).
        max_length: longest input in tokens (default: the model's max_seq_len).
        add_bos_token: prepend BOS to contexts; None (the default, as in the `hf` backend):
            when the model's tokenizer adds it in transformers (lmforge's tokenizers and
            Llama 3's do, as their pretraining data begins documents with it).
        max_gen_toks: default generation length when a task does not set one.
        seed: seed of the generator used for sampled generation.
        share_contexts: score log-likelihood requests with one context (a question's choices)
            as one row, the context once (`shared_context_logprobs`); False: each whole.
    """

    def __init__(
        self,
        source: str | Path | LoadedModel,
        *,
        batch_size: int = 8,
        device: str | torch.device = "cpu",
        dtype: str | torch.dtype | None = None,
        max_length: int | None = None,
        add_bos_token: bool | None = None,
        max_gen_toks: int = 256,
        seed: int = 1234,
        share_contexts: bool = True,
    ) -> None:
        super().__init__()
        if isinstance(source, LoadedModel):
            loaded = source
            self._device = next(loaded.model.parameters()).device
        else:  # split over the processes under torchrun (tensor parallel), else whole
            loaded = parallel.load_model(source, device=str(device), dtype=dtype)
            self._device = loaded.model.tok_embeddings.weight.device
        if loaded.tokenizer is None:
            raise ModelFormatError(
                f"{loaded.source}: has no tokenizer (tokenizer.json or tokenizer.model); "
                "lm-eval tasks are text, so evaluation needs one"
            )
        if batch_size < 1:
            raise ConfigError(f"batch_size must be >= 1, got {batch_size}")
        self.loaded = loaded
        self.model = loaded.model.eval()
        # Scoring multiplies many rows at once: on CUDA, quantized weights expanded to bf16 for
        # cuBLAS instead of torchao's int8 kernel and tinygemm (1B products at 64 rows on an
        # H200: 0.6-4.8 ms and 23-155 us, against 10-77 us)
        use_quantized_kernels(self.model, self._device)
        self.tokenizer = loaded.tokenizer
        self.batch_size = batch_size
        self.max_length = max_length or loaded.config.max_seq_len
        self.add_bos_token = self.tokenizer.adds_bos if add_bos_token is None else add_bos_token
        self.max_gen_toks = max_gen_toks
        self.share_contexts = share_contexts
        self._seeds = torch.Generator().manual_seed(seed)  # one sampling seed per batch
        self._generator: Generator | None = None  # see `_engine`
        specials = sorted(self.tokenizer.special_tokens, key=len, reverse=True)
        self._special_pattern = re.compile("|".join(map(re.escape, specials))) if specials else None

    # --- tokens ----------------------------------------------------------------------------

    @property
    def eot_token_id(self) -> int | None:
        return self.tokenizer.eos_id

    @property
    def prefix_token_id(self) -> int:
        """What an empty context (and each rolling window's first position) is conditioned on."""
        bos = self.tokenizer.bos_id
        return bos if bos is not None else self.tokenizer.eos_id

    def tok_encode(self, text: str, *, add_bos: bool | None = None) -> list[int]:
        """Ids of `text` as a transformers tokenizer gives them: special-token text becomes the
        special id; BOS first (when `add_bos`, default `add_bos_token`) unless already there."""
        ids: list[int] = []
        position = 0
        if self._special_pattern is not None:
            for match in self._special_pattern.finditer(text):
                ids += self.tokenizer.encode(text[position : match.start()])
                ids.append(self.tokenizer.special_tokens[match.group()])
                position = match.end()
        ids += self.tokenizer.encode(text[position:])
        add_bos = self.add_bos_token if add_bos is None else add_bos
        bos, bos_text = self.tokenizer.bos_id, self.tokenizer.bos_token
        if add_bos and bos is not None and not (bos_text and text.startswith(bos_text)):
            ids.insert(0, bos)
        return ids

    def _encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        # Spaces at the end of the context belong to the continuation's first word.
        num_spaces = len(context) - len(context.rstrip())
        if num_spaces:
            context, continuation = context[:-num_spaces], context[-num_spaces:] + continuation
        # Encode together, then split: what a word's tokens are depends on its left neighbour.
        whole = self.tok_encode(context + continuation)
        context_ids = self.tok_encode(context)
        return context_ids, whole[len(context_ids) :]

    # --- lm-eval's three request types -----------------------------------------------------

    def loglikelihood(
        self, requests: list[Instance], disable_tqdm: bool = False
    ) -> list[tuple[float, bool]]:
        sequences = []
        for context, continuation in (request.args for request in requests):
            if context == "":
                continuation_ids = self.tok_encode(continuation, add_bos=False)
                if continuation_ids and continuation_ids[0] == self.prefix_token_id:
                    context_ids, continuation_ids = continuation_ids[:1], continuation_ids[1:]
                else:
                    context_ids = [self.prefix_token_id]
            else:
                context_ids, continuation_ids = self._encode_pair(context, continuation)
            # Longer than the model takes: drop context from the left.
            tokens = (context_ids + continuation_ids)[-(self.max_length + 1) :]
            sequences.append((tokens, min(len(continuation_ids), len(tokens) - 1)))
        results = self._score(
            sequences, desc="loglikelihood", disable=disable_tqdm, share=self.share_contexts
        )
        for request, result in zip(requests, results):
            self.cache_hook.add_partial("loglikelihood", request.args, result)
        return results

    def loglikelihood_rolling(
        self, requests: list[Instance], disable_tqdm: bool = False
    ) -> list[float]:
        """Sum of log-probabilities of every token of each text, given the prefix token.

        The text is cut into disjoint chunks of `max_length` scored tokens; each chunk is
        scored with the `max_length` tokens before its end as input, so the last chunk gets a
        full context. The prefix token (BOS) conditions the first token and is not scored.
        """
        windows, owners = [], []
        for index, (text,) in enumerate(request.args for request in requests):
            full = [self.prefix_token_id, *self.tok_encode(text, add_bos=False)]
            begin = 1  # the first target position in `full`
            while begin < len(full):
                end = min(begin + self.max_length, len(full))
                start = max(0, end - 1 - self.max_length)
                windows.append((full[start:end], end - begin))
                owners.append(index)
                begin = end
        scores = self._score(windows, desc="loglikelihood_rolling", disable=disable_tqdm)
        totals = [0.0] * len(requests)
        for owner, (logprob, _) in zip(owners, scores):
            totals[owner] += logprob
        for request, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    def _score(
        self, sequences: list[tuple[list[int], int]], *, desc: str, disable: bool, share=False
    ) -> list[tuple[float, bool]]:
        """`sequence_logprobs` one batch at a time, with progress between batches. The batches
        are those one call would make (longest first, a stable sort, unscored sequences left
        out), so the results are the same to the bit. `share`: sequences whose context
        others have too (a question's choices) go through `shared_context_logprobs` instead,
        `batch_size` contexts at a time."""
        results = [(0.0, True)] * len(sequences)  # what sequence_logprobs gives n = 0
        shared = [g for g in context_groups(sequences) if len(g) > 1] if share else []
        shared.sort(key=lambda g: -sum(len(sequences[i][0]) for i in g))
        in_shared = {i for g in shared for i in g}
        order = sorted(
            (i for i, (_, n) in enumerate(sequences) if n > 0 and i not in in_shared),
            key=lambda i: -len(sequences[i][0]),
        )
        size = self.batch_size
        batches = [
            *(([i for g in shared[at : at + size] for i in g], shared_context_logprobs)
              for at in range(0, len(shared), size)),
            *((order[at : at + size], sequence_logprobs) for at in range(0, len(order), size)),
        ]  # fmt: skip
        with Progress(len(sequences), desc, unit="requests", disable=disable) as progress:
            progress.update(len(sequences) - len(order) - len(in_shared))
            for batch, score in batches:
                chosen = [sequences[i] for i in batch]
                scored = score(self.model, chosen, batch_size=size, device=self.device)
                for i, result in zip(batch, scored):
                    results[i] = result
                progress.update(len(batch))
        return results

    def generate_until(self, requests: list[Instance], disable_tqdm: bool = False) -> list[str]:
        from lm_eval.models.utils import normalize_gen_kwargs

        progress = Progress(len(requests), "generate_until", unit="requests", disable=disable_tqdm)
        outputs: list[str | None] = [None] * len(requests)
        groups: dict[str, list[int]] = {}
        for index, request in enumerate(requests):
            key = json.dumps(request.args[1], sort_keys=True, default=str)
            groups.setdefault(key, []).append(index)
        for indices in groups.values():
            kwargs = normalize_gen_kwargs(dict(requests[indices[0]].args[1]), self.max_gen_toks)
            until = kwargs.pop("until") or []
            max_new = kwargs.pop("max_gen_toks")
            ignored = sorted(set(kwargs) - SAMPLING_KEYS)
            if ignored:
                logger.warning("generation settings not supported, ignored: %s", ", ".join(ignored))
            max_context = self.max_length - max_new
            if max_context < 1:
                raise ConfigError(
                    f"max_gen_toks {max_new} leaves no room for a prompt in max_length "
                    f"{self.max_length}"
                )
            prompts = {i: self.tok_encode(requests[i].args[0])[-max_context:] for i in indices}
            ordered = sorted(indices, key=lambda i: -len(prompts[i]))
            for start in range(0, len(ordered), self.batch_size):
                batch = ordered[start : start + self.batch_size]
                texts = self._generate(
                    [prompts[i] for i in batch],
                    max_new_tokens=max_new,
                    stop_strings=until,
                    do_sample=bool(kwargs.get("do_sample")),
                    temperature=float(kwargs.get("temperature") or 0.0),
                    top_k=kwargs.get("top_k"),
                    top_p=kwargs.get("top_p"),
                )
                for i, text in zip(batch, texts):
                    outputs[i] = text
                    self.cache_hook.add_partial("generate_until", requests[i].args, text)
                progress.update(len(batch))
        progress.close()
        return outputs  # type: ignore[return-value]

    def _generate(
        self,
        prompts: list[list[int]],
        *,
        max_new_tokens: int,
        stop_strings: Sequence[str],
        do_sample: bool,
        temperature: float,
        top_k: int | None,
        top_p: float | None,
    ) -> list[str]:
        """Continue a batch of prompts with the inference engine; the text of each without
        special tokens (as the `hf` backend decodes), cut before its first stop string."""
        params = SamplingParams(
            max_new_tokens=max_new_tokens,
            temperature=temperature if do_sample else 0.0,
            top_k=top_k,
            top_p=top_p or 1.0,
            stop=tuple(s for s in stop_strings if s),
        )
        engine = self._engine(max(map(len, prompts)) + max_new_tokens)
        seed = int(torch.randint(2**62, (1,), generator=self._seeds))
        texts = []
        for result in engine.generate(prompts, params, seed=seed).results:
            ids = [t for t in result.token_ids if t not in self.tokenizer.stop_ids]
            text = self.tokenizer.decode(ids, skip_special=True)
            for stop in params.stop:
                text = text.split(stop)[0]
            texts.append(text)
        return texts

    def _engine(self, length: int) -> Generator:
        """The one Generator, its cache holding at least `length` tokens per row: made at the
        first request's size (a power of two, at most the context), replaced by a larger one
        only for a longer request (lm-eval sends the longest first), so its decode step
        compiles once; a decode step reads only the cache slots its sequences use."""
        size = min(self.max_length, self.loaded.config.max_seq_len, 1 << (length - 1).bit_length())
        if self._generator is None or self._generator.max_seq_len < size:
            self._generator = None  # the old cache goes before the new one is made
            # few-shot prompts share their examples: keep two contexts' worth of blocks
            self._generator = Generator(
                self.model,
                self.tokenizer,
                max_batch=self.batch_size,
                max_seq_len=size,
                prefix_cache_tokens=2 * size,
            )
        return self._generator

    # --- chat format -----------------------------------------------------------------------

    @property
    def tokenizer_name(self) -> str:
        return f"lmforge-{self.tokenizer.fingerprint()[:16]}"

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        return self.tokenizer.chat_template if chat_template else None

    def apply_chat_template(
        self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> str:
        """The conversation rendered with the model's chat template. Without a generation
        prompt the last (assistant) message is left open, to be continued."""
        if self.tokenizer.chat_template is None:
            raise ModelFormatError(
                f"{self.loaded.source}: the tokenizer has no chat template; evaluate without --chat"
            )
        if add_generation_prompt or not chat_history:
            return self.tokenizer.apply_chat_template(chat_history, add_generation_prompt=True)
        rendered = self.tokenizer.apply_chat_template(chat_history, add_generation_prompt=False)
        final = str(chat_history[-1].get("content", "")).strip()
        cut = rendered.rfind(final)
        return rendered[: cut + len(final)] if cut >= 0 else rendered

    def get_model_info(self) -> dict:
        lineage = self.loaded.lineage or {}
        return {
            "model_num_parameters": sum(p.numel() for p in self.model.parameters()),
            "model_dtype": str(next(self.model.parameters()).dtype),
            "model_source": self.loaded.source,
            "model_stage": lineage.get("stage"),
            "model_hash": lineage.get("hash"),
        }


# ----------------------------------------------------------------------------------------------
# Tasks


@functools.lru_cache(maxsize=4)
def _task_manager(include_path: tuple[str, ...], include_defaults: bool):
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=list(include_path) or None, include_defaults=include_defaults)


def _load_task_manager(tasks: Sequence[str], include_path: tuple[str, ...]):
    """A TaskManager that knows `tasks`: only the include paths when they hold them all (fast),
    else with lm-eval's own tasks too (indexing those takes seconds)."""
    if include_path:
        local = _task_manager(include_path, False)
        if set(tasks) <= set(local.all_tasks):
            return local
    return _task_manager(include_path, True)


def check_tasks(task_manager, tasks: Sequence[str], include_path: Sequence[str]) -> None:
    """Load each task once so that a missing task or dataset is a one-line error naming it."""
    for task in tasks:
        try:
            task_manager.load([task])
        except KeyError:
            where = f" nor a task in {', '.join(include_path)}" if include_path else ""
            raise ConfigError(
                f"unknown task {task!r}: not an lm-eval task, group or tag{where} "
                "(`lm-eval ls tasks` lists lm-eval's; a local task is a YAML file in a directory "
                "given with --include-path)"
            ) from None
        except OSError as err:  # offline and not cached, missing data file, no such dataset
            reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise DataError(
                f"task {task!r}: its dataset cannot be loaded ({reason}); offline, a hub dataset "
                "must already be in the datasets cache (HF_DATASETS_CACHE) - or provide the data "
                "locally: a task YAML with `dataset_path: json` and `dataset_kwargs: {data_files: "
                "{test: FILE.jsonl}}` in a directory given with --include-path"
            ) from None


# ----------------------------------------------------------------------------------------------
# The runner


@dataclass
class EvalResult:
    """One artifact's evaluation: lm-eval's results (JSON-safe) and where they were written."""

    source: str
    results: dict
    path: Path | None = None
    extra: dict = field(default_factory=dict)


def _json_safe(value):
    from lm_eval.utils import handle_non_serializable

    return json.loads(json.dumps(value, default=handle_non_serializable))


def _timestamp() -> str:
    return datetime.datetime.now().strftime("%Y%m%d-%H%M%S")


def results_path(source: str | Path, out: str | Path | None, *, kind: str = "results") -> Path:
    """`<out>/<kind>-<name>-<time>.json` when `out` is given, else `<artifact>/eval/<kind>-<time>.json`
    (a preset, which has no directory, needs `out`)."""
    stamp = _timestamp()
    if out is not None:
        directory, stem = Path(out), f"{kind}-{Path(str(source)).name or 'model'}-{stamp}"
    elif Path(str(source)).is_dir():
        directory, stem = Path(source) / "eval", f"{kind}-{stamp}"
    else:
        raise ConfigError(
            f"{source}: not a directory, so results have no place beside it; give --out"
        )
    path, suffix = directory / f"{stem}.json", 1
    while path.exists():  # two runs within one second
        path, suffix = directory / f"{stem}.{suffix}.json", suffix + 1
    return path


def write_results(path: Path, payload: dict) -> Path:
    """Write JSON atomically (temp file, then rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    staging.write_text(json.dumps(payload, indent=2) + "\n")
    os.replace(staging, path)
    return path


def model_record(source: str | Path) -> dict:
    """Source, hash and stage of a model, for results files."""
    record: dict = {"source": str(source)}
    path = Path(str(source))
    if path.is_dir() and (path / "config.json").exists():
        record["hash"] = artifact_hash(path)
        if (path / LINEAGE_NAME).exists():
            record["stage"] = read_json(path / LINEAGE_NAME).get("stage")
    return record


@contextlib.contextmanager
def quiet_lm_eval() -> Iterator[None]:
    """lm-eval records the git commit of the working directory with `git describe`, whose
    "fatal: not a git repository" reaches the user's terminal outside a checkout: the same
    lookup with git's stderr dropped. Its environment record (torch's collect_env: a dozen
    subprocesses, ~0.7 s a model) is not collected: `run_eval` keeps none of it."""
    import lm_eval.evaluator

    def git_hash() -> str | None:
        command = ["git", "describe", "--always"]
        try:
            done = subprocess.run(command, capture_output=True, text=True, check=True)
        except (OSError, subprocess.CalledProcessError):  # no git, or not a checkout
            return None
        return done.stdout.strip() or None

    with (
        mock.patch.object(lm_eval.evaluator, "get_git_commit_hash", git_hash),
        mock.patch.object(lm_eval.evaluator, "add_env_info", lambda results: None),
    ):
        yield


def run_eval(
    sources: Sequence[str | Path],
    tasks: Sequence[str],
    *,
    include_path: str | Path | Sequence[str | Path] | None = None,
    limit: int | float | None = None,
    batch_size: int = 8,
    device: str = "cpu",
    dtype: str | None = None,
    num_fewshot: int | None = None,
    apply_chat_template: bool = False,
    max_length: int | None = None,
    log_samples: bool = False,
    seed: int = 1234,
    out: str | Path | None = None,
    write: bool = True,
    share_contexts: bool = True,
) -> list[EvalResult]:
    """Evaluate lm-eval tasks on each model source, one after the other.

    Args:
        sources: artifacts (or any `lmforge.load` source).
        tasks: lm-eval task, group or tag names, or names of tasks in `include_path`.
        include_path: director(y/ies) of local task YAMLs.
        limit: examples per task (a fraction when < 1), for quick runs.
        num_fewshot: few-shot examples (default: each task's own).
        apply_chat_template: render prompts with the model's chat template (instruct models).
        log_samples: keep per-example requests and responses in the results (key "samples").
        out: directory for the results files (default: `<artifact>/eval/`).
        write: write the results files at all.
        share_contexts: score a question's choices as one row, the question once (LmforgeLM).

    Returns:
        one `EvalResult` per source, in order; `.results` has lm-eval's "results", "versions",
        "n-samples", "higher_is_better", "configs" (and "samples"), plus "lmforge" (model
        record, settings, and runtime: seconds of the evaluation and its peak memory).
    """
    import lm_eval

    if not tasks:
        raise ConfigError("no tasks given; name lm-eval tasks or local ones (--tasks)")
    if isinstance(include_path, (str, Path)):
        include_path = [include_path]
    paths = tuple(str(Path(p).expanduser().resolve()) for p in include_path or ())
    for path in paths:
        if not Path(path).is_dir():
            raise ConfigError(f"include path {path}: no such directory (of task YAML files)")
    tasks = list(dict.fromkeys(tasks))
    task_manager = _load_task_manager(tasks, paths)
    check_tasks(task_manager, tasks, paths)

    settings = {
        "tasks": tasks,
        "include_path": list(paths),
        "limit": limit,
        "num_fewshot": num_fewshot,
        "batch_size": batch_size,
        "device": str(resolve_device(device)),
        "dtype": dtype,
        "apply_chat_template": apply_chat_template,
        "max_length": max_length,
        "seed": seed,
    }
    evaluated = []
    for source in sources:
        lm = LmforgeLM(
            source,
            batch_size=batch_size,
            device=device,
            dtype=dtype,
            max_length=max_length,
            seed=seed,
            share_contexts=share_contexts,
        )
        if lm.device.type == "cuda":  # the evaluation's peak, not the loading's
            torch.cuda.reset_peak_memory_stats(lm.device)
        start = time.perf_counter()
        with quiet_lm_eval():
            raw = lm_eval.simple_evaluate(
                model=lm,
                tasks=tasks,
                task_manager=task_manager,
                num_fewshot=num_fewshot,
                limit=limit,
                batch_size=batch_size,
                device=settings["device"],
                log_samples=log_samples,
                apply_chat_template=apply_chat_template,
                random_seed=seed,
                numpy_random_seed=seed,
                torch_random_seed=seed,
                fewshot_random_seed=seed,
            )
        runtime = _runtime(time.perf_counter() - start, lm.device)
        if raw is None:  # tensor parallel: lm-eval reports on rank 0 only
            continue
        keys = [
            "results",
            "groups",
            "group_subtasks",
            "versions",
            "n-shot",
            "n-samples",
            "higher_is_better",
            "configs",
        ]
        if log_samples:
            keys.append("samples")
        results = _json_safe({key: raw[key] for key in keys if key in raw})
        results["lmforge"] = {
            "model": model_record(lm.loaded.source),
            "settings": settings,
            "runtime": runtime,
        }
        path = results_path(source, out) if write else None
        if path is not None:
            write_results(path, results)
        evaluated.append(EvalResult(source=str(source), results=results, path=path))
        del lm, raw
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return evaluated


def _runtime(seconds: float, device: torch.device) -> dict:
    """The evaluation's seconds and peak memory after loading (CUDA max allocated, or the
    process's peak RSS on the CPU); under tensor parallelism the largest of the processes and
    each one's (a collective: every process calls it)."""
    peaks = parallel.gather_from_all(peak_memory_bytes(device))
    return {
        "evaluate_s": round(seconds, 3),
        "device": str(device),
        "peak_memory_bytes": max(peaks),
        "process_peak_memory_bytes": peaks,
    }


# ----------------------------------------------------------------------------------------------
# Tables


def metric_rows(results: dict) -> dict[tuple[str, str], tuple[float, float | None]]:
    """(task, metric) -> (value, stderr) from lm-eval's "results"; the "none" filter is left
    out of the metric name, other filters are kept ("exact_match,flexible-extract")."""
    rows = {}
    for task, metrics in results.get("results", {}).items():
        for key, value in metrics.items():
            if "," not in key or "_stderr," in key or not isinstance(value, (int, float)):
                continue
            metric, filter_name = key.split(",", 1)
            stderr = metrics.get(f"{metric}_stderr,{filter_name}")
            name = metric if filter_name == "none" else f"{metric},{filter_name}"
            stderr = stderr if isinstance(stderr, (int, float)) else None
            rows[(task, name)] = (float(value), None if stderr is None else float(stderr))
    return rows


def _plus_minus(value: float, stderr: float | None, *, sign: bool = False) -> str:
    text = f"{value:+.4f}" if sign else f"{value:.4f}"
    return f"{text} ± {stderr:.4f}" if stderr is not None and math.isfinite(stderr) else text


def _render(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = [
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in [header, *rows]
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def format_results_table(results: dict) -> str:
    """task | metric | value ± stderr | n for one artifact."""
    samples = results.get("n-samples", {})
    rows = []
    for (task, metric), (value, stderr) in metric_rows(results).items():
        count = samples.get(task, {}).get("effective")
        rows.append([task, metric, _plus_minus(value, stderr), "" if count is None else str(count)])
    return _render(["task", "metric", "value ± stderr", "n"], rows)


def _names(sources: Sequence[str]) -> list[str]:
    short = [Path(s).name or s for s in sources]
    return short if len(set(short)) == len(short) else [str(s) for s in sources]


def format_comparison_table(evaluated: Sequence[EvalResult]) -> str:
    """task | metric | one column per artifact (value ± stderr) | delta of each later artifact
    against the first (± the two standard errors combined as if independent)."""
    names = _names([e.source for e in evaluated])
    tables = [metric_rows(e.results) for e in evaluated]
    keys = list(dict.fromkeys(key for table in tables for key in table))
    header = ["task", "metric", *names]
    header += [f"Δ {name} - {names[0]}" for name in names[1:]]
    rows = []
    for key in keys:
        cells = [key[0], key[1]]
        cells += [_plus_minus(*table[key]) if key in table else "-" for table in tables]
        first = tables[0].get(key)
        for table in tables[1:]:
            other = table.get(key)
            if first is None or other is None:
                cells.append("-")
                continue
            errors = [e for e in (first[1], other[1]) if e is not None]
            stderr = math.sqrt(sum(e * e for e in errors)) if len(errors) == 2 else None
            cells.append(_plus_minus(other[0] - first[0], stderr, sign=True))
        rows.append(cells)
    return _render(header, rows)
