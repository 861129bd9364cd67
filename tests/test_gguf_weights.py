"""Linear weights read as the GGUF's Q4_1 blocks (specstack.gguf_weights): the same bits as the bf16 weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specstack.gguf_weights import BLOCK_BYTES, attach_q4_1, from_gguf_blocks, q4_1_weights
from specstack.packed_linear import PackedLinear, load_rows_kernel

ROWS_KERNEL = load_rows_kernel()
needs_bf16_dots = pytest.mark.skipif(ROWS_KERNEL is None or not ROWS_KERNEL.bf16, reason="no AVX-512 bf16 dot products here: bf16 rows keep F.linear")


def random_blocks(out: int, inp: int, seed: int = 0) -> torch.Tensor:
    """[out, inp / 32 * 24] uint8, as the kernel reads them, from GGUF's Q4_1 blocks with random codes and float16 scales and offsets of the
    sizes a trained layer has (|d| ~ 0.01, |m| ~ 0.1)."""
    rng = np.random.default_rng(seed)
    n = out * inp // 32
    blocks = np.empty((n, BLOCK_BYTES), dtype=np.uint8)
    blocks[:, 0:2] = (rng.standard_normal(n) * 0.01).astype(np.float16).view(np.uint8).reshape(n, 2)
    blocks[:, 2:4] = (rng.standard_normal(n) * 0.1).astype(np.float16).view(np.uint8).reshape(n, 2)
    blocks[:, 4:] = rng.integers(0, 256, size=(n, 16), dtype=np.uint8)
    return from_gguf_blocks(torch.from_numpy(blocks.reshape(out, -1)))


def bf16_layer(blocks: torch.Tensor, bias: bool) -> PackedLinear:
    weight = q4_1_weights(blocks, torch.bfloat16)  # [out, in]
    layer = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=bias, dtype=torch.bfloat16)
    with torch.no_grad():
        layer.weight.copy_(weight)
    PackedLinear.adopt(layer, ROWS_KERNEL)
    return layer


def test_blocks_widen_as_the_gguf_reader_widens_them() -> None:
    gguf = pytest.importorskip("gguf")
    rng = np.random.default_rng(5)
    weights = (rng.standard_normal((6, 96)) * 0.05).astype(np.float32)
    blocks = gguf.quants.quantize(weights, gguf.GGMLQuantizationType.Q4_1)  # [6, 3 * 20]
    theirs = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q4_1).reshape(6, 96)  # [6, 96]
    ours = q4_1_weights(from_gguf_blocks(torch.from_numpy(blocks)))  # [6, 96]
    assert np.array_equal(ours.numpy().view(np.uint32), theirs.astype(np.float32).view(np.uint32))


@needs_bf16_dots
@pytest.mark.parametrize("out_features", [8, 10, 1, 40])
@pytest.mark.parametrize("bias", [False, True])
def test_rows_reading_blocks_are_the_same_bits_as_rows_reading_the_bf16_weight(out_features, bias) -> None:
    """Every row count the kernel takes (on AMX tiles from TILES_FROM rows where there are tiles), output counts
    that leave a short last group of four or of sixteen, with a bias."""
    layer = bf16_layer(random_blocks(out_features, 160, seed=out_features), bias)
    if bias:
        with torch.no_grad():
            layer.bias.copy_(torch.randn(out_features, generator=torch.Generator().manual_seed(1)))
    rows = ROWS_KERNEL.max_rows(torch.bfloat16)
    x = torch.randn(rows, 160, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    with torch.no_grad():
        for n in range(1, rows + 1):
            plain = layer(x[:n])  # [n, out], the bf16 weight
            layer.attach_blocks(random_blocks(out_features, 160, seed=out_features))
            read = layer(x[:n])  # [n, out], the blocks
            assert layer._blocks_for is not None, "the blocks were not used"
            assert torch.equal(read.view(torch.int16), plain.view(torch.int16)), n
            layer._blocks = None


@needs_bf16_dots
def test_blocks_that_do_not_widen_to_the_weight_are_dropped_and_the_weight_is_read() -> None:
    layer = bf16_layer(random_blocks(8, 64), bias=False)
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    with torch.no_grad():
        plain = layer(x)  # [2, 8], the bf16 weight
        layer.attach_blocks(random_blocks(8, 64, seed=9))  # another matrix's blocks
        assert torch.equal(layer(x), plain)
        assert layer._blocks is None
        layer.attach_blocks(random_blocks(8, 64))
        layer(x)
        assert layer._blocks is not None
        layer.weight.add_(1.0)  # an in-place update: the blocks no longer widen to it
        expected = bf16_layer(random_blocks(8, 64), bias=False)
        with torch.no_grad():
            expected.weight.add_(1.0)
        assert torch.equal(layer(x), expected(x)) and layer._blocks is None


@pytest.mark.real_model
@needs_bf16_dots
def test_the_embedded_targets_bf16_forward_reads_every_layer_matrix_as_blocks_with_the_same_logits() -> None:
    """Every q, k, v, o, gate, up and down matrix of the GGUF widens exactly to the bf16 target's weight
    (q and k with their rows back in transformers' order), and a forward's logits are the same bits."""
    from specstack.batch import TokenBatch
    from specstack.models import find_gguf, load_target

    target = load_target(dtype=torch.bfloat16)[0]
    layers = target.module.config.num_hidden_layers
    fused = [layer.qkv.linear for layer in target.decoder.layers] + [layer.gate_up.linear for layer in target.decoder.layers]
    assert sum(m._blocks is not None for m in target.module.modules() if isinstance(m, PackedLinear)) == 7 * layers
    assert all(m._blocks is not None for m in fused)
    most = ROWS_KERNEL.max_rows(torch.bfloat16)  # 6, or 32 on AMX tiles
    assert target.linear_bytes_per_weight(1) == target.linear_bytes_per_weight(most) == 0.75  # the floor counts the blocks' bytes
    assert target.linear_bytes_per_weight(most + 1) == 2  # wider products read the bf16 weights (oneDNN)
    tokens = [1, 504, 3458, 314, 253, 1345, 2330, 30]

    def logits() -> torch.Tensor:
        store = target.new_cache(16)
        target.forward(TokenBatch.chain(tokens[:5], start=0, num_logits=1), store)  # a prefill of five
        steps = [target.forward(TokenBatch.chain([t], start=5 + i, num_logits=1), store) for i, t in enumerate(tokens[5:])]  # one row each
        store.truncate(5)
        verify = target.forward(TokenBatch.chain(tokens[5:], start=5, num_logits=3), store)  # three rows (the streaming kernel)
        store.truncate(0)
        wide = target.forward(TokenBatch.chain(tokens, start=0, num_logits=8), store)  # eight rows (the tiles, where there are tiles)
        return torch.cat([*steps, verify, wide])  # [14, V]

    read = logits()
    for m in [*target.module.modules(), *fused]:
        if isinstance(m, PackedLinear):
            m._blocks = None
    assert torch.equal(read.view(torch.int16), logits().view(torch.int16))
    assert attach_q4_1(target.module, find_gguf()) == 7 * layers
