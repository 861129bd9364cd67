"""A model's linear weights kept as its GGUF file stores them: Q4_1 and Q8_0 blocks.

The embedded default is shipped as a GGUF whose every decoder-layer matrix is Q4_1 and whose embedding,
tied to the LM head, is Q8_0. transformers widens them to float32 when it reads the file (4 bytes a
weight), and a bfloat16 model rounds those to bf16 (2 bytes). A forward of a few tokens is bound by
reading the weights, so it can read the blocks instead, widened in registers to the very numbers the
model holds (:mod:`specstack.weight_formats`): the same outputs from 0.75 bytes a weight (Q4_1) or 1.125
(Q8_0).

:func:`attach_gguf_blocks` reads each Q4_1 layer matrix of a Llama-family GGUF and its Q8_0 embedding,
puts the rows of q and k in transformers' order (the GGUF stores them permuted for its own rotary
layout), and hands the blocks to the matching :class:`~specstack.packed_linear.PackedLinear` (the
embedding to the LM head) only where they widen, bit for bit, to that layer's current weight: a model
loaded from another file, or whose weights were changed, keeps its own. Nothing else about the model
changes.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from .packed_linear import PackedLinear
from .weight_formats import Q4_1, Q8_0, WeightFormat, q4_1_rows, q8_0_rows

# The GGUF name of each layer matrix -> its module under transformers' ``model.layers.{i}``.
LAYER_MATRICES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                  "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
HEAD = "lm_head"  # takes the Q8_0 embedding (token_embd) where the model ties the two


def _rows_in_transformers_order(name: str, rows: int, heads: int, kv_heads: int) -> np.ndarray | None:
    """Which GGUF row each of transformers' rows of matrix ``name`` is (None: the same order). llama.cpp's
    converter interleaves the two rotary halves of each q and k head; transformers' reader undoes it."""
    n = {"attn_q": heads, "attn_k": kv_heads}.get(name)
    if n is None:
        return None
    return np.arange(rows).reshape(n, rows // n // 2, 2).transpose(0, 2, 1).reshape(-1)


def read_blocks(path: str | Path, heads: int, kv_heads: int) -> dict[str, tuple[WeightFormat, torch.Tensor]]:
    """Every Q4_1 layer matrix of the GGUF at ``path`` as ``{"model.layers.{i}.{module}": (Q4_1, rows)}``, rows
    in transformers' order, and a Q8_0 embedding as ``{"lm_head": (Q8_0, rows)}`` (:mod:`specstack.weight_formats`)."""
    from gguf import GGMLQuantizationType, GGUFReader

    found = {}
    for tensor in GGUFReader(str(path)).tensors:
        parts = tensor.name.split(".")  # blk.{i}.{matrix}.weight, or token_embd.weight
        if tensor.tensor_type == GGMLQuantizationType.Q8_0 and tensor.name == "token_embd.weight":
            found[HEAD] = (Q8_0, q8_0_rows(_blocks_of(tensor)))
        elif tensor.tensor_type == GGMLQuantizationType.Q4_1 and len(parts) == 4 and parts[0] == "blk" and parts[2] in LAYER_MATRICES:
            order = _rows_in_transformers_order(parts[2], int(tensor.shape[1]), heads, kv_heads)
            found[f"model.layers.{parts[1]}.{LAYER_MATRICES[parts[2]]}"] = (Q4_1, q4_1_rows(_blocks_of(tensor, order)))
    return found


def _blocks_of(tensor, order: np.ndarray | None = None) -> torch.Tensor:
    """A GGUF tensor's blocks [out, in / 32 * block bytes] uint8, rows in ``order``: a copy, so the file stays closed."""
    data = np.asarray(tensor.data).reshape(int(tensor.shape[1]), -1)  # GGUF lists shapes innermost first
    return torch.from_numpy(np.array(data if order is None else data[order]))


def attach_gguf_blocks(module: torch.nn.Module, path: str | Path) -> int:
    """Give each :class:`PackedLinear` of ``module`` (a transformers Llama-family model) the blocks of the
    GGUF at ``path`` that widen exactly to its weight and that the kernel reads for its dtype; returns how
    many took them."""
    config = module.config
    blocks = read_blocks(path, config.num_attention_heads, config.num_key_value_heads)
    taken = 0
    for name, linear in module.named_modules():
        format, stored = blocks.get(name, (None, None))
        if isinstance(linear, PackedLinear) and stored is not None and format.reads(linear.weight.dtype):
            if stored.shape[0] == linear.weight.shape[0] and torch.equal(format.weights(stored, linear.weight.dtype), linear.weight.detach()):
                linear.attach_blocks(stored, format)
                taken += 1
    return taken
