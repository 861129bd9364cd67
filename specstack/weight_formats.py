"""The narrower formats a linear layer's weights can be read in instead, bit for bit.

A forward of a few tokens is bound by reading the weights (docs/benchmarks.md). Where a layer's weights
are exactly the numbers of a narrower format, the few-row kernel (``csrc/linear_rows.cpp``) reads that
format and widens each block of 32 weights in registers to those very numbers, then takes the same
products in the same order as over the weights themselves: the same bits from fewer bytes.

- ``q4_1``: GGUF's Q4_1 blocks (each 32 weights of a row share a float16 scale ``d`` and offset ``m``,
  each weight a four-bit code ``q``, ``w = d·q + m``), each block as its 16 code bytes followed by
  (d, m) as float32: 0.75 bytes a weight. Read by fp32 and bf16 rows.
- ``q8_0``: GGUF's Q8_0 blocks (a float16 scale ``d`` per 32 signed 8-bit codes, ``w = d·q``), each block
  as its 32 code bytes followed by d as float32: 1.125 bytes a weight. Read by fp32 and bf16 rows (a tied LM
  head over the GGUF's Q8_0 embedding).
- ``bf16``: float32 weights that are bf16 numbers (a draft's embedding frozen in bf16), each block of 32 as
  their upper halves: 2 bytes a weight. fp32 rows.

The float16 scales are kept as float32 (exact copies) to spare the kernel a conversion per block.

The kernel streams :data:`GROUP_ROWS` weight rows side by side, so the stored rows [out, in / 32 ·
block_bytes] lie in groups of that many rows (the last group holds what is left), each group block-major:
block ``b`` of the group's row ``i`` at ``(b · rows_in_group + i) · block_bytes`` from the group's start,
which is its first row's start. A group is then one stream from memory instead of four rows' (and
their scales') streams: :func:`grouped` and :func:`blocks_of` convert, :func:`join_rows` stacks stored
matrices. On the AMD Zen 4 host the bf16 target's one-token forward over 512 cached slots took 1.55x less
time so, the bf16 draft's 1.82x (docs/benchmarks.md, "Weight rows stored four at a time").
:mod:`specstack.gguf_weights` reads the GGUF's blocks; :class:`~specstack.packed_linear.PackedLinear`
reads a format only while it widens to the layer's weight bit for bit.
"""

from __future__ import annotations

from typing import Callable, Mapping

import attrs
import torch

Q4_1_GGUF_BYTES = 20  # a Q4_1 block in the file: float16 d, float16 m, 16 bytes of codes (q_i in byte i's low nibble, q_{i+16} in its high)
Q8_0_GGUF_BYTES = 34  # a Q8_0 block in the file: float16 d, 32 signed code bytes


@attrs.frozen(kw_only=True, eq=False)  # each format is one object, compared by identity
class WeightFormat:
    """How a layer's weights are stored for the kernel: ``block_bytes`` per 32 weights of a row, the
    float32 weights ``widen`` makes of the stored rows [out, in / 32 * block_bytes] uint8, and the kernel
    entry that reads them for rows of each activation dtype."""

    name: str
    block_bytes: int
    widen: Callable[[torch.Tensor], torch.Tensor] = attrs.field(repr=False)
    entries: Mapping[torch.dtype, str]
    tiles_entry: str | None = None  # the entry that widens bf16 products' A tiles from the blocks (AMX builds), if any

    @property
    def bytes_per_weight(self) -> float:
        return self.block_bytes / 32

    def weights(self, stored: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """stored [out, in / 32 * block_bytes] -> the weights [out, in] of ``dtype`` they stand for."""
        return self.widen(stored).to(dtype)

    def reads(self, dtype: torch.dtype) -> bool:
        """Whether the kernel reads this format for rows of ``dtype``."""
        return dtype in self.entries


GROUP_ROWS = 4  # weight rows the kernel streams side by side (csrc/linear_rows.cpp: ROWS)


def grouped(blocks: torch.Tensor) -> torch.Tensor:
    """Each row's blocks [out, in / 32, block_bytes] uint8 -> the stored rows [out, in / 32 * block_bytes]:
    groups of :data:`GROUP_ROWS` rows (the last holds what is left), each group block-major."""
    out, count, size = blocks.shape
    full = out - out % GROUP_ROWS
    parts = [blocks[:full].reshape(-1, GROUP_ROWS, count, size).transpose(1, 2).reshape(full, count * size)]  # [full, in / 32 * size]
    if full < out:
        parts.append(blocks[full:].transpose(0, 1).reshape(out - full, count * size))  # [out % 4, in / 32 * size]
    return torch.cat(parts)


def blocks_of(stored: torch.Tensor, block_bytes: int) -> torch.Tensor:
    """The stored rows [out, in / 32 * block_bytes] (:func:`grouped`) -> each row's blocks [out, in / 32, block_bytes]."""
    out, count = stored.shape[0], stored.shape[1] // block_bytes
    full = out - out % GROUP_ROWS
    parts = [stored[:full].reshape(-1, count, GROUP_ROWS, block_bytes).transpose(1, 2).reshape(full, count, block_bytes)]
    if full < out:
        parts.append(stored[full:].reshape(count, out - full, block_bytes).transpose(0, 1))  # [out % 4, in / 32, size]
    return torch.cat(parts)


def join_rows(parts: list[torch.Tensor], format: "WeightFormat") -> torch.Tensor:
    """Stored matrices of one format (each [out_i, in / 32 * block_bytes]) -> the stored rows of all their rows,
    in order (a fused product's weight: q, k and v stacked)."""
    return grouped(torch.cat([blocks_of(part, format.block_bytes) for part in parts]))


def q4_1_rows(blocks: torch.Tensor) -> torch.Tensor:
    """GGUF's Q4_1 blocks [out, in / 32 * 20] -> the rows the kernel reads [out, in / 32 * 24]: each block's
    16 code bytes, then its (d, m) as float32 (exact copies of the float16s), the rows grouped (:func:`grouped`)."""
    out = blocks.shape[0]
    b = blocks.reshape(out, -1, Q4_1_GGUF_BYTES)  # [out, in / 32, 20]
    scales = b[..., 0:4].contiguous().view(torch.float16).float()  # [out, in / 32, 2]: d, m
    return grouped(torch.cat([b[..., 4:], scales.view(torch.uint8)], dim=2))  # [out, in / 32 * 24]


def q4_1_weights(rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """rows [out, in / 32 * 24] (:func:`q4_1_rows`) -> the weights [out, in] they stand for:
    ``(d·q) + m`` in float32 (a product, then a sum, as the GGUF reader computes them), cast to ``dtype``."""
    b = blocks_of(rows, Q4_1.block_bytes)  # [out, in / 32, 24]
    codes = b[..., :16].long()  # [out, in / 32, 16]
    dm = b[..., 16:].contiguous().view(torch.float32)  # [out, in / 32, 2]
    q = torch.cat([codes & 0x0F, codes >> 4], dim=-1).float()  # [out, in / 32, 32]: q_0 .. q_31
    return ((dm[..., :1] * q) + dm[..., 1:]).reshape(rows.shape[0], -1).to(dtype)  # [out, in]


def q8_0_rows(blocks: torch.Tensor) -> torch.Tensor:
    """GGUF's Q8_0 blocks [out, in / 32 * 34] -> the rows the kernel reads [out, in / 32 * 36]: each block's
    32 code bytes, then its scale d as float32 (an exact copy of the float16), the rows grouped (:func:`grouped`)."""
    out = blocks.shape[0]
    b = blocks.reshape(out, -1, Q8_0_GGUF_BYTES)  # [out, in / 32, 34]
    scales = b[..., 0:2].contiguous().view(torch.float16).float()  # [out, in / 32, 1]
    return grouped(torch.cat([b[..., 2:], scales.view(torch.uint8)], dim=2))  # [out, in / 32 * 36]


def q8_0_weights(rows: torch.Tensor) -> torch.Tensor:
    """rows [out, in / 32 * 36] (:func:`q8_0_rows`) -> the float32 weights [out, in]: ``d·q``, exact."""
    b = blocks_of(rows, Q8_0.block_bytes)  # [out, in / 32, 36]
    q = b[..., :32].contiguous().view(torch.int8).float()  # [out, in / 32, 32]
    d = b[..., 32:].contiguous().view(torch.float32)  # [out, in / 32, 1]
    return (d * q).reshape(rows.shape[0], -1)  # [out, in]


def bf16_rows(weight: torch.Tensor) -> torch.Tensor | None:
    """A float32 weight [out, in] as the rows the kernel reads [out, in * 2] (its bf16 bit patterns, the rows
    grouped: :func:`grouped`), or None where it is not made of bf16 numbers (then reading bf16 would change it)."""
    halves = weight.detach().to(torch.bfloat16)  # [out, in]
    if not torch.equal(halves.float(), weight.detach()):
        return None
    return grouped(halves.view(torch.uint8).reshape(weight.shape[0], -1, BF16.block_bytes))  # [out, in * 2]


def bf16_weights(rows: torch.Tensor) -> torch.Tensor:
    """rows [out, in * 2] (:func:`bf16_rows`) -> the float32 weights [out, in], exact."""
    return blocks_of(rows, BF16.block_bytes).reshape(rows.shape[0], -1).view(torch.bfloat16).float()  # [out, in]


Q4_1 = WeightFormat(name="q4_1", block_bytes=24, widen=q4_1_weights,
                    entries={torch.float32: "specstack_linear_rows_q4_1_f32", torch.bfloat16: "specstack_linear_rows_q4_1_bf16"},
                    tiles_entry="specstack_linear_rows_q4_1_bf16_tiles")
# bf16 rows widen each Q8_0 block to bf16 in registers (seven instructions a block). From grouped rows that costs
# less than the bytes it saves at every row count the kernel takes: the bf16 target's LM head alone (49152 x 576,
# AMD Zen 4, 2 threads) took 2.96x / 2.22x / 2.13x / 2.01x / 1.33x / 1.14x less time at 1 / 3 / 4 / 6 / 8 / 16 rows
# than over the bf16 weight (rows stored one after another, it had lost from four rows on).
Q8_0 = WeightFormat(name="q8_0", block_bytes=36, widen=q8_0_weights,
                    entries={torch.float32: "specstack_linear_rows_q8_0_f32", torch.bfloat16: "specstack_linear_rows_q8_0_bf16"},
                    tiles_entry="specstack_linear_rows_q8_0_bf16_tiles")
BF16 = WeightFormat(name="bf16", block_bytes=64, widen=bf16_weights,
                    entries={torch.float32: "specstack_linear_rows_bf16_f32"})
