"""torchtitan Llama 3 DCP checkpoints -> artifacts: layouts, numerics and errors.

The checkpoints are written here the way torchtitan's CheckpointManager writes them
(`torchtitan/components/checkpoint.py`): `dcp.save` of the model's state dict flattened to the
top level (current versions) or nested under "model" (older full checkpoints), next to
optimizer / lr_scheduler / dataloader / train_state entries, with wq/wk in the interleaved RoPE
layout of torchtitan's complex `freqs_cis` rotation; torchtitan 0.3's names
(`attention.qkv_linear.wq`, `lm_head`) too. (Checked once by hand against torchtitan 0.3.0's
own debugmodel: logits within 1e-6; the suite does not depend on torchtitan.)
"""

from __future__ import annotations

import io
import os
import pickle
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

import lmforge
from lmforge import cli
from lmforge.api import build_model, detect_format
from lmforge.errors import ModelFormatError
from lmforge.models.llama import get_preset
from lmforge.models.llama import hf as llama_hf
from lmforge.models.llama.model import rope_inv_freq
from lmforge.models.llama.torchtitan import (
    find_checkpoint,
    is_torchtitan_checkpoint,
    read_torchtitan_checkpoint,
)
from tests.train_utils import small_args

SMALL = small_args(256)


def _half_to_interleaved(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    # inverse of interleaved_to_half: [heads, 2, head_dim/2, dim] -> [heads, head_dim/2, 2, dim]
    out_dim, dim = weight.shape
    return (
        weight.view(num_heads, 2, out_dim // num_heads // 2, dim)
        .transpose(1, 2)
        .reshape(out_dim, dim)
    )


def _small_model(args=SMALL, seed=0):
    model = build_model(args, seed=seed).eval()
    with torch.no_grad():  # non-trivial norms, so a mixed-up norm shows in the logits
        generator = torch.Generator().manual_seed(seed + 100)
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.randn(param.shape, generator=generator) * 0.1)
    return model


def _torchtitan_state(model) -> dict[str, torch.Tensor]:
    """The model's weights under torchtitan's names and RoPE layout (the names are ours)."""
    args = model.args
    state = {}
    for name, tensor in model.state_dict().items():
        tensor = tensor.detach().clone()
        if name.endswith("attention.wq.weight"):
            tensor = _half_to_interleaved(tensor, args.num_heads)
        elif name.endswith("attention.wk.weight"):
            tensor = _half_to_interleaved(tensor, args.num_kv_heads)
        state[name] = tensor
    return state


def _v03_name(name: str) -> str:
    """torchtitan 0.3's key for one of ours."""
    if name == "output.weight":
        return "lm_head.weight"
    for w in ("wq", "wk", "wv"):
        name = name.replace(f".attention.{w}.", f".attention.qkv_linear.{w}.")
    return name


def _save(directory, model, *, prefix="", weights_only=False, dtype=None, extra=None, v03=False):
    """Write a DCP checkpoint like torchtitan's CheckpointManager."""
    weights = _torchtitan_state(model)
    if v03:
        weights = {_v03_name(name): tensor for name, tensor in weights.items()}
    # older torchtitan versions kept the RoPE buffer persistent
    weights["freqs_cis"] = torch.polar(torch.ones(16, 8), torch.randn(16, 8))
    if dtype is not None:
        weights = {n: t.to(dtype) if t.is_floating_point() else t for n, t in weights.items()}
    state = {"model": weights} if prefix == "model." else dict(weights)
    if not weights_only:
        state["optimizer"] = {
            "state": {
                name: {"exp_avg": torch.zeros_like(t), "step": torch.tensor(7.0)}
                for name, t in list(weights.items())[:2]
            },
            "param_groups": [{"lr": 3e-4, "params": list(weights)[:2]}],
        }
        state["lr_scheduler"] = {"last_epoch": 7, "_step_count": 8}
        state["dataloader"] = {"world_size": 1, "dp_rank_0": b"\x80\x04pickled-state"}
        # torchtitan's TrainState: a tensor step plus torch.save'd lists in BytesIO
        state["train_state"] = {
            "step": torch.tensor(7, dtype=torch.int32),
            "log_steps": io.BytesIO(b"x"),
        }
    state.update(extra or {})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(directory), no_dist=True)
    return directory


def _config_dir(tmp_path, args=SMALL, name="config"):
    directory = tmp_path / name
    directory.mkdir()
    (directory / "config.json").write_text(
        __import__("json").dumps(llama_hf.args_to_hf_config(args, torch.float32))
    )
    return directory


def _tokens(vocab_size, seed=1):
    return torch.randint(0, vocab_size, (2, 23), generator=torch.Generator().manual_seed(seed))


def _torchtitan_forward(state: dict[str, torch.Tensor], args, tokens) -> torch.Tensor:
    """torchtitan's Llama 3 forward (model.py: complex `freqs_cis` on adjacent pairs), written
    independently of our model, on torchtitan-layout weights."""
    heads, kv_heads, head_dim = args.num_heads, args.num_kv_heads, args.head_dim
    batch, seq_len = tokens.shape
    positions = torch.arange(seq_len, dtype=torch.float32)
    freqs_cis = torch.polar(
        torch.ones(seq_len, head_dim // 2), torch.outer(positions, rope_inv_freq(args))
    )

    def rms(x, weight):
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + args.norm_eps))

    def rotate(x):  # [b, s, h, d]: pairs (0,1), (2,3), ... are complex numbers
        x_ = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        return torch.view_as_real(x_ * freqs_cis[None, :, None, :]).flatten(3)

    h = state["tok_embeddings.weight"][tokens]
    for i in range(args.num_layers):
        p = f"layers.{i}."
        x = rms(h, state[p + "attention_norm.weight"])
        q = (x @ state[p + "attention.wq.weight"].T).view(batch, seq_len, heads, head_dim)
        k = (x @ state[p + "attention.wk.weight"].T).view(batch, seq_len, kv_heads, head_dim)
        v = (x @ state[p + "attention.wv.weight"].T).view(batch, seq_len, kv_heads, head_dim)
        q, k = rotate(q), rotate(k)
        k = k.repeat_interleave(heads // kv_heads, dim=2)
        v = v.repeat_interleave(heads // kv_heads, dim=2)
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        h = h + out.transpose(1, 2).reshape(batch, seq_len, -1) @ state[p + "attention.wo.weight"].T
        x = rms(h, state[p + "ffn_norm.weight"])
        gate = torch.nn.functional.silu(x @ state[p + "feed_forward.w1.weight"].T)
        up = x @ state[p + "feed_forward.w3.weight"].T
        h = h + (gate * up) @ state[p + "feed_forward.w2.weight"].T
    return rms(h, state["norm.weight"]) @ state["output.weight"].T


def _convert(monkeypatch, *argv) -> int:
    from lmforge.commands import model

    monkeypatch.setattr(cli, "COMMAND_MODULES", [model])
    return cli.main(["convert", *map(str, argv)])


# ---- numerics -----------------------------------------------------------------------------


def test_convert_full_checkpoint_is_exact_and_loads_in_transformers(tmp_path, monkeypatch):
    transformers = pytest.importorskip("transformers")
    model = _small_model()
    checkpoint = _save(tmp_path / "dump" / "checkpoint" / "step-7", model)
    assert detect_format(checkpoint) == "torchtitan"
    out = tmp_path / "artifact"
    assert _convert(monkeypatch, checkpoint, out, "--model-config", _config_dir(tmp_path)) == 0

    tokens = _tokens(SMALL.vocab_size)
    converted = lmforge.load(out)
    assert converted.config == SMALL
    with torch.no_grad():
        expected = model(tokens)
        assert torch.equal(converted.model(tokens), expected)
        hf = transformers.LlamaForCausalLM.from_pretrained(out).eval()
        assert (hf(tokens).logits - expected).abs().max().item() <= 1e-5
    for name, tensor in model.state_dict().items():
        assert torch.equal(converted.model.state_dict()[name], tensor), name


def test_matches_a_torchtitan_style_forward_on_its_own_weights(tmp_path):
    # Independent of our inverse permutation: torchtitan's complex-RoPE forward, run on the
    # interleaved weights as stored, gives the logits of the imported model.
    model = _small_model(seed=3)
    checkpoint = _save(tmp_path / "step-1", model, weights_only=True)
    loaded = lmforge.load(checkpoint, model_config=str(_config_dir(tmp_path)))
    tokens = _tokens(SMALL.vocab_size, seed=4)
    with torch.no_grad():
        reference = _torchtitan_forward(_torchtitan_state(model), SMALL, tokens)
        assert (loaded.model(tokens) - reference).abs().max().item() <= 1e-5


def test_older_model_prefixed_layout_and_newest_complete_step(tmp_path):
    dump = tmp_path / "dump"
    _save(dump / "checkpoint" / "step-10", _small_model(seed=10), prefix="model.")
    newest_complete = _small_model(seed=20)
    _save(dump / "checkpoint" / "step-20", newest_complete, prefix="model.")
    (dump / "checkpoint" / "step-30").mkdir()  # a save that never wrote .metadata
    truncated = _save(dump / "checkpoint" / "step-40", _small_model(seed=40), prefix="model.")
    data_file = next(truncated.glob("*.distcp"))
    data_file.write_bytes(data_file.read_bytes()[:100])  # killed while writing its data

    assert find_checkpoint(dump) == dump / "checkpoint" / "step-20"
    assert is_torchtitan_checkpoint(dump) and detect_format(dump) == "torchtitan"
    args, state = read_torchtitan_checkpoint(dump, SMALL)
    assert args == SMALL
    for name, tensor in newest_complete.state_dict().items():
        assert torch.equal(state[name], tensor), name


def test_torchtitan_03_names_with_a_tied_lm_head(tmp_path):
    tied_args = SMALL.replace(tie_embeddings=True)
    model = _small_model(tied_args, seed=5)
    model.output.weight = model.tok_embeddings.weight  # build_model's to_empty unties them
    # torchtitan 0.3's 1B/3B flavors tie lm_head to tok_embeddings: both keys are saved
    assert torch.equal(model.state_dict()["output.weight"], model.tok_embeddings.weight)
    checkpoint = _save(tmp_path / "step-2", model, v03=True)
    loaded = lmforge.load(checkpoint, model_config=str(_config_dir(tmp_path, tied_args)))
    tokens = _tokens(SMALL.vocab_size, seed=6)
    with torch.no_grad():
        assert torch.equal(loaded.model(tokens), model(tokens))
    with pytest.raises(
        ModelFormatError,
        match=r"tok_embeddings\.weight has shape \(256, 64\), the model config implies \(128256, 2048\)",
    ):
        read_torchtitan_checkpoint(checkpoint, "1B")


def test_weights_only_bfloat16_export_keeps_dtype_and_debugmodel_flavor(tmp_path):
    # torchtitan's debugmodel flavor: dim 256, 16 heads, ffn 768; layers and vocab vary by version
    flavor_args = get_preset("tiny").replace(
        dim=256, num_layers=1, num_heads=16, num_kv_heads=16, ffn_dim=768, vocab_size=300
    )
    model = _small_model(flavor_args)
    checkpoint = _save(tmp_path / "step-5", model, weights_only=True, dtype=torch.bfloat16)
    loaded = lmforge.load(checkpoint, model_config="debugmodel")
    assert loaded.config.num_heads == 16 and loaded.config.rope_theta == 500000.0
    assert loaded.config.rope_scaling is not None  # current torchtitan scales like Llama 3.1
    assert (loaded.config.num_layers, loaded.config.vocab_size) == (1, 300)
    assert loaded.model.tok_embeddings.weight.dtype == torch.bfloat16
    expected = model.layers["0"].attention.wq.weight.to(torch.bfloat16)
    assert torch.equal(loaded.model.layers["0"].attention.wq.weight, expected)


def test_model_config_accepts_params_json_and_presets(tmp_path):
    model = _small_model()
    checkpoint = _save(tmp_path / "step-1", model, weights_only=True)
    params = tmp_path / "meta" / "params.json"
    params.parent.mkdir()
    params.write_text(
        '{"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 256, '
        '"multiple_of": 128, "ffn_dim_multiplier": 0.75, "norm_eps": 1e-05, "rope_theta": 10000.0}'
    )
    args, _ = read_torchtitan_checkpoint(checkpoint, str(params.parent))
    assert (args.num_heads, args.num_kv_heads, args.ffn_dim) == (4, 2, 128)
    with pytest.raises(ModelFormatError, match=r"tok_embeddings.weight has shape \(256, 64\)"):
        read_torchtitan_checkpoint(checkpoint, "llama3.2-1b")


# ---- errors -------------------------------------------------------------------------------


def test_missing_model_config_names_the_flag_and_the_shapes(tmp_path, monkeypatch, capsys):
    checkpoint = _save(tmp_path / "step-1", _small_model(), weights_only=True)
    with pytest.raises(ModelFormatError, match=r"--model-config.*num_layers 2.*dim 64"):
        lmforge.load(checkpoint)
    assert _convert(monkeypatch, checkpoint, tmp_path / "out") == 2
    error = capsys.readouterr().err
    assert error.startswith(f"error: {checkpoint}") and "--model-config" in error
    assert len(error.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_shapes_that_disagree_with_the_config(tmp_path):
    checkpoint = _save(tmp_path / "step-1", _small_model(), weights_only=True)
    wrong_kv = _config_dir(tmp_path, SMALL.replace(num_kv_heads=4), name="wrong")
    with pytest.raises(ModelFormatError, match=r"step-1: tensor layers.0.attention.wk.weight"):
        lmforge.load(checkpoint, model_config=str(wrong_kv))
    deeper = _config_dir(tmp_path, SMALL.replace(num_layers=3), name="deeper")
    with pytest.raises(ModelFormatError, match=r"missing \['layers.2"):
        read_torchtitan_checkpoint(checkpoint, str(deeper))
    tied = _config_dir(tmp_path, SMALL.replace(tie_embeddings=True), name="tied")
    with pytest.raises(ModelFormatError, match=r"output\.weight differs"):
        read_torchtitan_checkpoint(checkpoint, str(tied))
    with pytest.raises(ModelFormatError, match="--model-config 'nope'"):
        read_torchtitan_checkpoint(checkpoint, "nope")


def test_not_a_dcp_directory(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelFormatError, match="empty: not a DCP checkpoint"):
        read_torchtitan_checkpoint(tmp_path / "empty", SMALL)
    with pytest.raises(ModelFormatError, match="empty: not a model directory"):
        detect_format(tmp_path / "empty")
    assert not is_torchtitan_checkpoint(tmp_path / "empty")


def test_no_model_weights_inside(tmp_path):
    state = {"optimizer": {"param_groups": [{"lr": 0.1}]}, "train_state": {"step": torch.tensor(3)}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(tmp_path / "step-3"), no_dist=True)
        dcp.save(
            {"model": {"model": {"tok_embeddings.weight": torch.zeros(2, 2)}}},
            checkpoint_id=str(tmp_path / "ours"),
            no_dist=True,
        )
    with pytest.raises(
        ModelFormatError, match=r"no torchtitan Llama model weights.*optimizer, train_state"
    ):
        detect_format(tmp_path / "step-3")
    with pytest.raises(ModelFormatError, match="lmforge export"):
        read_torchtitan_checkpoint(tmp_path / "ours", SMALL)


def test_unsupported_tensors_are_named(tmp_path):
    extra = {"layers.0.attention.q_norm.weight": torch.ones(16)}
    checkpoint = _save(tmp_path / "step-1", _small_model(), weights_only=True, extra=extra)
    with pytest.raises(ModelFormatError, match=r"q_norm\.weight is not part of a plain Llama 3"):
        lmforge.load(checkpoint, model_config=str(_config_dir(tmp_path)))


class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def test_metadata_pickle_is_never_executed(tmp_path):
    checkpoint = _save(tmp_path / "step-1", _small_model(), weights_only=True)
    marker = tmp_path / "pwned"
    (checkpoint / ".metadata").write_bytes(pickle.dumps(_Payload(str(marker))))
    with pytest.raises(ModelFormatError, match=r"cannot read DCP metadata \(refusing to load"):
        read_torchtitan_checkpoint(checkpoint, SMALL)
    assert not marker.exists()
