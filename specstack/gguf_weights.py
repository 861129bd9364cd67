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

import struct
from pathlib import Path

import attrs
import numpy as np
import torch

from .errors import SpecstackError
from .packed_linear import PackedLinear
from .weight_formats import Q4_1, Q4_1_GGUF_BYTES, Q8_0, Q8_0_GGUF_BYTES, WeightFormat, q4_1_rows, q8_0_rows

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
    found = {}
    for tensor in tensor_index(path):
        parts = tensor.name.split(".")  # blk.{i}.{matrix}.weight, or token_embd.weight
        if tensor.kind == GGML_Q8_0 and tensor.name == "token_embd.weight":
            found[HEAD] = (Q8_0, q8_0_rows(tensor.blocks(path)))
        elif tensor.kind == GGML_Q4_1 and len(parts) == 4 and parts[0] == "blk" and parts[2] in LAYER_MATRICES:
            order = _rows_in_transformers_order(parts[2], tensor.shape[0], heads, kv_heads)
            found[f"model.layers.{parts[1]}.{LAYER_MATRICES[parts[2]]}"] = (Q4_1, q4_1_rows(tensor.blocks(path, order)))
    return found


# -- the GGUF file's tensor index -------------------------------------------------------------------
# GGUF (ggml's file format, version 2 and 3): "GGUF", a u32 version, u64 tensor and metadata counts, the metadata
# (key, u32 type, value), then each tensor's name, u32 dims, u64 sizes (innermost first), u32 ggml type and u64
# offset into the data, which starts at the next multiple of general.alignment (32 by default). Read here
# directly: the gguf package's reader also turns every metadata string (the 49,152-token vocabulary) into
# arrays, which took 3-5 s per load.

GGML_Q4_1, GGML_Q8_0 = 3, 8  # ggml's type ids
BLOCK_BYTES = {GGML_Q4_1: Q4_1_GGUF_BYTES, GGML_Q8_0: Q8_0_GGUF_BYTES}  # per 32 weights in the file
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}  # metadata value types
_STRING, _ARRAY = 8, 9


@attrs.frozen
class GGUFTensor:
    name: str
    kind: int  # ggml type id
    shape: tuple[int, ...]  # outermost first: [out, in] for a matrix
    start: int  # byte offset of its data in the file

    def blocks(self, path: str | Path, order: np.ndarray | None = None) -> torch.Tensor:
        """The tensor's blocks [out, in / 32 * block bytes] uint8, rows in ``order``: a copy, so the file stays closed."""
        out, inp = self.shape
        data = np.memmap(path, dtype=np.uint8, mode="r", offset=self.start, shape=(out, inp // 32 * BLOCK_BYTES[self.kind]))
        return torch.from_numpy(np.array(data if order is None else data[order]))


def tensor_index(path: str | Path) -> list[GGUFTensor]:
    """The tensors of the GGUF file at ``path`` (their data not read)."""
    with open(path, "rb") as f:
        read = lambda fmt: struct.unpack("<" + fmt, f.read(struct.calcsize("<" + fmt)))[0]
        if f.read(4) != b"GGUF" or read("I") not in (2, 3):
            raise SpecstackError(f"{path} is not a GGUF file of version 2 or 3")
        tensors, fields = read("Q"), read("Q")
        alignment = 32
        for _ in range(fields):
            key = f.read(read("Q")).decode()
            value = _metadata_value(f, read, read("I"))
            if key == "general.alignment":
                alignment = value
        index = []
        for _ in range(tensors):
            name = f.read(read("Q")).decode()
            dims = [read("Q") for _ in range(read("I"))]
            index.append((name, read("I"), tuple(reversed(dims)), read("Q")))
        data = -(-f.tell() // alignment) * alignment
    return [GGUFTensor(name=name, kind=kind, shape=shape, start=data + offset) for name, kind, shape, offset in index]


def _metadata_value(f, read, kind: int):
    """One metadata value of type ``kind`` (arrays and strings skipped over; None for them)."""
    if kind in _SCALARS:
        return read(_SCALARS[kind])
    if kind == _STRING:
        f.seek(read("Q"), 1)
        return None
    if kind == _ARRAY:
        item, count = read("I"), read("Q")
        if item in _SCALARS:
            f.seek(count * struct.calcsize("<" + _SCALARS[item]), 1)
        else:
            for _ in range(count):
                _metadata_value(f, read, item)
        return None
    raise SpecstackError(f"unknown GGUF metadata type {kind}")


def attach_gguf_blocks(module: torch.nn.Module, path: str | Path) -> int:
    """Give each :class:`PackedLinear` of ``module`` (a transformers Llama-family model) the blocks of the
    GGUF at ``path`` that widen exactly to its weight and that the kernel reads for its dtype; returns how
    many took them."""
    config = module.config
    blocks = read_blocks(path, config.num_attention_heads, config.num_key_value_heads)
    taken = 0
    for name, linear in module.named_modules():
        format, stored = blocks.get(name, (None, None))
        if isinstance(linear, PackedLinear) and stored is not None and linear.attach_exact_blocks(stored, format):
            taken += 1
    return taken
