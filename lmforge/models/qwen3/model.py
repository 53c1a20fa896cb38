"""The Qwen3 dense transformer: Llama's blocks (lmforge/models/llama/model.py) with an RMSNorm
over each query and key head before RoPE, and head_dim set by the config rather than
dim / num_heads. Everything else (GQA, SwiGLU, RMSNorm, rotate-half RoPE, tied embeddings,
the forward's arguments) is Llama's, reused as it is.
"""

from __future__ import annotations

from lmforge.models.llama.model import Transformer as LlamaTransformer


class Transformer(LlamaTransformer):
    """tokens [batch, seq] (int64) -> logits [batch, seq, vocab]; attention.q_norm and
    attention.k_norm weights [head_dim] in every block."""

    qk_norm = True
