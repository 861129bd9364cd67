"""The linear layers of a model on the CPU, through oneDNN with a packed copy of each weight.

On the 2-core AVX2 EPYC this project runs on (torch 2.13, MKL 2024.2, 2 threads), ``F.linear`` in
fp32 takes two rows at twice the cost of one, and the LM head 2-8 rows at 2.1-2.8x one row, so a
verify of a few tokens cost nearly as much as that many single steps. oneDNN's inner-product primitive
over a weight reordered once into its blocked layout (the kernel inductor uses for frozen CPU linears)
measured, for SmolLM2-135M's 210 layer matrices, 28 / 27 / 33 / 37 / 48 ms for 1 / 2 / 4 / 8 / 16 rows
against ``F.linear``'s 33-39 / 52-56 / 54-59 / 46-50 / 56-61 ms, and for its LM head 5.5 / 6.1 / 7.0 /
8.2 / 11 ms against 10 / 21 / 24 / 25 / 30 ms (docs/benchmarks.md, "The linear layers"). Results
differ from ``F.linear``'s by rounding only.

This module is the one place that choice is made. :func:`pack_linears` turns a model's ``nn.Linear``
layers into :class:`PackedLinear` (the same module, parameters and state dict, another forward); each
packs its weight on its first fp32 CPU forward without autograd and keeps ``F.linear`` for every other
case (another dtype or device, a forward that records gradients, a build without oneDNN)."""

from __future__ import annotations

import torch

PACKED_FOR_ROWS = 4  # the row count oneDNN's reorder is told to expect: measured best over 1-32 rows here (hint 1 doubled 2 rows' cost)


def onednn_available() -> bool:
    """Whether this torch build has the oneDNN linear ops (private to torch, so checked, not assumed)."""
    mkldnn = torch.ops.mkldnn
    return torch.backends.mkldnn.is_available() and hasattr(mkldnn, "_reorder_linear_weight") and hasattr(mkldnn, "_linear_pointwise")


class PackedLinear(torch.nn.Linear):
    """``nn.Linear`` whose fp32 CPU forward without autograd runs oneDNN over a packed weight copy.

    The copy is remade whenever the weight changes (its storage, which ``.to()`` and ``.data =``
    replace, or its version counter, which an optimizer's in-place step advances), so it is never stale. It is a plain attribute, not a buffer:
    ``state_dict``, ``.to()`` and saving see an ordinary ``nn.Linear``."""

    _packed: torch.Tensor | None
    _packed_from: tuple | None

    @classmethod
    def adopt(cls, linear: torch.nn.Linear) -> None:
        """Give ``linear`` (exactly an ``nn.Linear``) this forward, in place."""
        linear.__class__ = cls
        linear._packed, linear._packed_from = None, None

    def __getstate__(self) -> dict:
        """Copies and pickles leave the packed weight out (oneDNN's layout has no storage to copy)."""
        return {**self.__dict__, "_packed": None, "_packed_from": None}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] -> [..., out]."""
        packed = self._packed_weight(x)
        if packed is None:
            return torch.nn.functional.linear(x, self.weight, self.bias)  # [..., out]
        return torch.ops.mkldnn._linear_pointwise(x, packed, self.bias, "none", [], "")  # [..., out]

    def _packed_weight(self, x: torch.Tensor) -> torch.Tensor | None:
        weight = self.weight
        if (x.device.type != "cpu" or x.dtype != torch.float32
                or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))):
            return None
        source = (weight.data_ptr(), 0 if weight.is_inference() else weight._version)  # new storage or an in-place write
        if self._packed_from != source:
            with torch.no_grad():
                self._packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACKED_FOR_ROWS)  # [out, in], oneDNN layout
            self._packed_from = source
        return self._packed


def pack_linears(module: torch.nn.Module) -> int:
    """Give every ``nn.Linear`` in ``module`` (subclasses left alone) the :class:`PackedLinear`
    forward, in place; returns how many. Does nothing where oneDNN is missing."""
    if not onednn_available():
        return 0
    linears = [m for m in module.modules() if type(m) is torch.nn.Linear]
    for linear in linears:
        PackedLinear.adopt(linear)
    return len(linears)
