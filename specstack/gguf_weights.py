"""A model's linear weights kept as its GGUF file stores them: four-bit Q4_1 blocks.

The embedded default is shipped as a GGUF whose every linear layer is Q4_1 (ggml's block format:
each 32 weights of a row share a float16 scale ``d`` and offset ``m``, and each weight is a four-bit
code ``q``, so ``w = d·q + m``), 20 bytes per 32 weights. transformers widens them to float32 when it
reads the file, and a bfloat16 model rounds those to bf16: 2 bytes a weight. A forward of a few tokens
is bound by reading the weights (docs/benchmarks.md), so it can read the blocks instead and widen each
in registers to the very bf16 numbers the model holds (``csrc/linear_rows.cpp``,
``specstack_linear_rows_q4_1_bf16``): the same products, in the same order, from 0.75 bytes a weight instead of 2 (24 bytes per 32: the
float16 scales are kept as float32).

:func:`attach_q4_1` reads each Q4_1 matrix of a Llama-family GGUF, puts its rows in transformers'
order (the GGUF stores the rows of q and k permuted for its own rotary layout), and hands the blocks
to the matching :class:`~specstack.packed_linear.PackedLinear` only where they widen, bit for bit, to
that layer's current weight (:func:`q4_1_weights`): a model loaded from another file, or whose
weights were changed, keeps its own. Nothing else about the model changes.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from .packed_linear import PackedLinear

BLOCK_BYTES = 20  # in the file: float16 d, float16 m, 16 bytes of codes (q_i in byte i's low nibble, q_{i+16} in its high)
ROW_BYTES_PER_BLOCK = 24  # as the kernel reads them: the 16 code bytes, and d and m as float32 (with the row's other scales)
# The GGUF name of each layer matrix -> its module under transformers' ``model.layers.{i}``.
LAYER_MATRICES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                  "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}


def from_gguf_blocks(blocks: torch.Tensor) -> torch.Tensor:
    """GGUF's Q4_1 blocks [out, in / 32 * 20] -> the rows the kernel reads [out, in / 32 * 24]: each row's
    16 code bytes per block, then its blocks' (d, m) as float32 pairs (exact copies of the float16s)."""
    out = blocks.shape[0]
    b = blocks.reshape(out, -1, BLOCK_BYTES)  # [out, in / 32, 20]
    scales = b[..., 0:4].contiguous().view(torch.float16).float()  # [out, in / 32, 2]: d, m
    return torch.cat([b[..., 4:].reshape(out, -1), scales.reshape(out, -1).view(torch.uint8)], dim=1)  # [out, in / 32 * 24]


def q4_1_weights(rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """rows [out, in / 32 * 24] (:func:`from_gguf_blocks`) -> the weights [out, in] they stand for:
    ``(d·q) + m`` in float32 (a product, then a sum, as the GGUF reader computes them), cast to ``dtype``."""
    out, blocks = rows.shape[0], rows.shape[1] // ROW_BYTES_PER_BLOCK
    codes = rows[:, : 16 * blocks].reshape(out, blocks, 16).long()  # [out, in / 32, 16]
    dm = rows[:, 16 * blocks :].contiguous().view(torch.float32).reshape(out, blocks, 2)  # [out, in / 32, 2]
    q = torch.cat([codes & 0x0F, codes >> 4], dim=-1).float()  # [out, in / 32, 32]: q_0 .. q_31
    return ((dm[..., :1] * q) + dm[..., 1:]).reshape(out, -1).to(dtype)  # [out, in]


def _rows_in_transformers_order(name: str, rows: int, heads: int, kv_heads: int) -> np.ndarray | None:
    """Which GGUF row each of transformers' rows of matrix ``name`` is (None: the same order). llama.cpp's
    converter interleaves the two rotary halves of each q and k head; transformers' reader undoes it."""
    n = {"attn_q": heads, "attn_k": kv_heads}.get(name)
    if n is None:
        return None
    return np.arange(rows).reshape(n, rows // n // 2, 2).transpose(0, 2, 1).reshape(-1)


def read_q4_1(path: str | Path, heads: int, kv_heads: int) -> dict[str, torch.Tensor]:
    """Every Q4_1 layer matrix of the GGUF at ``path``, as ``{"model.layers.{i}.{module}": rows [out, in / 32 * 24]}``
    (:func:`from_gguf_blocks`), rows in transformers' order."""
    from gguf import GGMLQuantizationType, GGUFReader

    found = {}
    for tensor in GGUFReader(str(path)).tensors:
        parts = tensor.name.split(".")  # blk.{i}.{matrix}.weight
        if tensor.tensor_type != GGMLQuantizationType.Q4_1 or len(parts) != 4 or parts[0] != "blk" or parts[2] not in LAYER_MATRICES:
            continue
        data = np.asarray(tensor.data).reshape(int(tensor.shape[1]), -1)  # [out, in / 32 * 20]; GGUF lists shapes innermost first
        order = _rows_in_transformers_order(parts[2], data.shape[0], heads, kv_heads)
        found[f"model.layers.{parts[1]}.{LAYER_MATRICES[parts[2]]}"] = from_gguf_blocks(torch.from_numpy(np.array(data if order is None else data[order])))  # a copy: the file stays closed
    return found


def attach_q4_1(module: torch.nn.Module, path: str | Path) -> int:
    """Give each :class:`PackedLinear` of ``module`` (a transformers Llama-family model) the Q4_1 blocks
    of the GGUF at ``path`` that widen exactly to its weight; returns how many took them."""
    config = module.config
    blocks = read_q4_1(path, config.num_attention_heads, config.num_key_value_heads)
    taken = 0
    for name, linear in module.named_modules():
        stored = blocks.get(name)
        if isinstance(linear, PackedLinear) and stored is not None and linear.weight.dtype == torch.bfloat16:
            if torch.equal(q4_1_weights(stored, linear.weight.dtype), linear.weight.detach()):
                linear.attach_blocks(stored)
                taken += 1
    return taken
