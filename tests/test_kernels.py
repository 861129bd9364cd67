"""The LM head formulation specstack uses on the CPU (``hf.output_projection``): the head's own
logits up to rounding, for every row count, and the head's own forward wherever it does not apply."""

from __future__ import annotations

import pytest
import torch

from specstack.hf import output_projection


@pytest.mark.parametrize("rows", [1, 2, 3, 8, 32, 33])
def test_the_output_projection_is_the_heads_own_logits(rows) -> None:
    torch.manual_seed(0)
    head = torch.nn.Linear(64, 1000, bias=False)
    hidden = torch.randn(40, 64)[-rows:]  # [rows, H], a view as the forward passes it
    with torch.inference_mode():
        got, want = output_projection(head, hidden), head(hidden)  # [rows, V] each
    assert got.shape == want.shape == (rows, 1000)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.parametrize("head, dtype", [(torch.nn.Linear(64, 100, bias=True), torch.float32),
                                         (torch.nn.Linear(64, 100, bias=False), torch.bfloat16)])
def test_a_head_with_a_bias_or_in_bf16_keeps_its_own_forward(head, dtype) -> None:
    head = head.to(dtype)
    hidden = torch.randn(4, 64, dtype=dtype)
    with torch.inference_mode():
        assert torch.equal(output_projection(head, hidden), head(hidden))
