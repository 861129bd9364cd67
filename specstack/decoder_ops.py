"""The small operations of a decoder layer on the CPU, one compiled call each (``csrc/decoder_ops.cpp``).

Between its matrix products and its attention, a Llama-family layer makes some thirty small tensor
operations per forward in transformers' order: the RMSNorm alone is eight (to float32, square, mean,
add, rsqrt, multiply, back to the model's dtype, times the weight), the rotary embedding seven, the
MLP's SiLU(gate) * up three, each residual add one. For SmolLM2-135M that is about 900 calls and a fifth
of a bf16 one-token step. :class:`DecoderOps` makes the norms, residual adds and rotations three calls
a layer: each residual add fused with the norm after it, and the rotation of the queries and keys in
place. (SiLU(gate) * up stays torch's: a scalar loop with the C library's exponential was as slow as
the rest saved, at 16 rows.)

It follows transformers' arithmetic and its roundings (bf16 computed in float32 and rounded where
transformers' bf16 operations round): the residual adds and the rotation give transformers' bits;
the norm sums its squares in another order, so it may differ in a float32 last place and, rarely,
in a bf16 rounding. Every row is computed alone, so a
row's results are the same bits in a one-token step and in a verify. Where the library cannot be
built, :data:`TORCH_OPS` computes the same operations with torch, exactly as transformers does.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import attrs
import torch

from .native import SOURCES, CompiledLibrary, load

SOURCE = SOURCES / "decoder_ops.cpp"
DTYPES = {torch.float32: 0, torch.bfloat16: 1}  # the dtypes the compiled ops take, and the flag each passes


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[..., D] -> [..., D]: the second half negated, then the first (transformers' ``rotate_half``, RoPE's
    rotation by 90 degrees of each pair of dimensions i and i + D/2)."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


# transformers' norms that compute LlamaRMSNorm's formula, weight * dtype(h * rsqrt(mean(h^2) + eps)); any other keeps its own forward
RMS_NORMS = frozenset({"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm"})


@attrs.frozen
class TorchOps:
    """The operations as transformers computes them (the fallback, and the reference of the tests)."""

    def add_norm(self, hidden: torch.Tensor, delta: torch.Tensor | None, norm: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [.., H] (+ delta) -> (the sum, its norm): the residual add, then the norm module."""
        if delta is not None:
            hidden = hidden + delta  # [.., H]
        return hidden, norm.forward(hidden)

    def rotate(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int) -> torch.Tensor:
        """qkv [1, T, heads + more, D] -> its first ``heads`` heads rotated [1, T, heads, D] (a new tensor)."""
        qk = qkv[:, :, :heads]  # [1, T, heads, D]
        return qk * cos + rotate_half(qk) * sin  # [1, T, heads, D]


TORCH_OPS = TorchOps()


@attrs.frozen(kw_only=True)
class DecoderOps(CompiledLibrary):
    """The compiled operations, for float32 and bfloat16 tensors on the CPU; others go to :data:`TORCH_OPS`."""

    @classmethod
    def load_again(cls) -> "DecoderOps | None":
        return load_decoder_ops()

    @staticmethod
    def _ours(first: torch.Tensor, second: torch.Tensor, third: torch.Tensor | None = None) -> bool:
        """Whether the tensors are the compiled ops': one dtype they take, contiguous, on the CPU (called
        twice a layer per forward: no loop, no generator)."""
        dtype = first.dtype
        return (dtype in DTYPES and first.device.type == "cpu" and first.is_contiguous() and second.dtype == dtype and second.is_contiguous()
                and second.device.type == "cpu" and (third is None or (third.dtype == dtype and third.is_contiguous() and third.device.type == "cpu")))

    def add_norm(self, hidden: torch.Tensor, delta: torch.Tensor | None, norm: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [.., H] += delta (in place), and its RMSNorm [.., H]."""
        weight = norm.weight
        if type(norm).__name__ not in RMS_NORMS or not self._ours(hidden, weight, delta):
            return TORCH_OPS.add_norm(hidden, delta, norm)
        width = hidden.shape[-1]
        normed = torch.empty_like(hidden)  # [.., H]
        self.library.add_rms_norm(hidden.data_ptr(), None if delta is None else delta.data_ptr(), weight.data_ptr(), normed.data_ptr(),
                                  hidden.numel() // width, width, float(norm.variance_epsilon), DTYPES[hidden.dtype])
        return hidden, normed

    def rotate(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int) -> torch.Tensor:
        """qkv [1, T, heads + more, D] -> its first ``heads`` heads [1, T, heads, D], rotated in place."""
        dim = qkv.shape[-1]
        if not self._ours(qkv, cos, sin) or dim > 512 or cos.numel() != qkv.shape[1] * dim:
            return TORCH_OPS.rotate(qkv, cos, sin, heads)
        self.library.rotate(qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), qkv.shape[1], heads, dim, qkv.shape[2] * dim, DTYPES[qkv.dtype])
        return qkv[:, :, :heads]  # [1, T, heads, D]


def load_decoder_ops(cache: Path | None = None) -> DecoderOps | TorchOps:
    """The compiled operations, built into ``cache`` (default: the specstack cache) on first use;
    :data:`TORCH_OPS` where they cannot be built here."""
    pointer, c_int = ctypes.c_void_p, ctypes.c_int
    loaded = load(SOURCE, "add_rms_norm", [pointer] * 4 + [c_int, c_int, ctypes.c_float, c_int], cache)
    if loaded is None:
        return TORCH_OPS
    library, path = loaded
    library.rotate.restype, library.rotate.argtypes = c_int, [pointer] * 3 + [c_int] * 3 + [ctypes.c_int64, c_int]
    return DecoderOps(library=library, path=path)
