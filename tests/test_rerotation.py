"""StreamingLLM with cache-relative positions: keys moved by compaction are re-rotated exactly.

With a one-layer model a key depends only on its token and rotary position, so after eviction the
cache must give the same logits as a fresh pass over the kept tokens placed at slots 0, 1, 2, …
"""

from __future__ import annotations

import copy

import pytest
import torch

from specstack.batch import TokenBatch

from specstack import CachedModel, LevelStats, StreamingLLM
from specstack.hf import HFCausalLM

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def one_layer_llama() -> HFCausalLM:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=256)
    return HFCausalLM(module=LlamaForCausalLM(config), tokenizer_id="tiny")


def test_relative_positions_match_a_fresh_pass_over_the_kept_tokens(one_layer_llama) -> None:
    model = one_layer_llama
    lm = CachedModel(model, StreamingLLM(sinks=2, window=6), LevelStats(name="draft"))
    tokens = torch.randint(0, 64, (20,), generator=torch.Generator().manual_seed(1)).tolist()
    logits = lm.logits(tokens, 1)[0]  # [V]; evictions happened on the way
    kept = lm.cache.positions.tolist()
    assert len(kept) <= 8 and kept[:2] == [0, 1] and kept[-1] == 19
    fresh = model.new_cache(len(kept))
    expected = model.forward(TokenBatch.chain([tokens[p] for p in kept], 0, 1), fresh)[0]
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-5)


def test_absolute_positions_differ_from_a_fresh_pass(one_layer_llama) -> None:
    """The check above can fail: without re-rotation (absolute positions) the logits differ."""
    model = one_layer_llama
    lm = CachedModel(model, StreamingLLM(sinks=2, window=6, relative_positions=False), LevelStats(name="draft"))
    tokens = torch.randint(0, 64, (20,), generator=torch.Generator().manual_seed(1)).tolist()
    logits = lm.logits(tokens, 1)[0]
    kept = lm.cache.positions.tolist()
    fresh = model.new_cache(len(kept))
    expected = model.forward(TokenBatch.chain([tokens[p] for p in kept], 0, 1), fresh)[0]
    assert not torch.allclose(logits, expected, rtol=1e-4, atol=1e-5)


@pytest.fixture(scope="module")
def bf16_llama() -> HFCausalLM:
    """One layer in bfloat16 with SmolLM2's rotary frequencies (head_dim 64, rope_theta 100000)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=128, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=64, rope_theta=100_000.0, max_position_embeddings=8192)
    return HFCausalLM(module=LlamaForCausalLM(config).to(torch.bfloat16), tokenizer_id="tiny")


@torch.no_grad()
def _exact_keys(model: HFCausalLM, tokens: list[int]) -> torch.Tensor:
    """[H, n, D]: the layer's keys of ``tokens`` at slots 0..n-1, computed in float64 from the same
    weights: with one layer a key depends only on its token and its rotary position."""
    module = copy.deepcopy(model.module).double()
    layer = module.model.layers[0]
    ids = torch.tensor([tokens])  # [1, n]
    hidden = layer.input_layernorm(module.model.embed_tokens(ids))  # [1, n, E]
    heads, dim = module.config.num_key_value_heads, module.config.head_dim
    keys = layer.self_attn.k_proj(hidden).view(1, len(tokens), heads, dim).transpose(1, 2)  # [1, H, n, D]
    cos, sin = module.model.rotary_emb(keys, position_ids=torch.arange(len(tokens))[None])  # [1, n, D] each
    rotated = torch.cat([-keys[..., dim // 2 :], keys[..., : dim // 2]], dim=-1)  # rotate_half
    return (keys * cos[:, None] + rotated * sin[:, None])[0]  # [H, n, D]


def test_rerotation_does_not_drift_in_bf16_after_hundreds_of_evictions(bf16_llama) -> None:
    """One-slot evictions, token by token (the paper's StreamingLLM): the oldest window key has moved
    255 times, yet every key stays one rotation (one bf16 rounding) from its exact rotation. Rotating
    the stored bf16 key by each move's delta drifts to a cosine of about 0.975."""
    model = bf16_llama
    lm = CachedModel(model, StreamingLLM(sinks=4, window=256, reserve=1), LevelStats(name="draft"))
    tokens = torch.randint(0, 64, (560,), generator=torch.Generator().manual_seed(2)).tolist()
    for end in range(1, len(tokens) + 1):
        lm.logits(tokens[:end], 1)  # one token at a time, as a draft decodes
    kept = lm.cache.positions.tolist()
    assert kept[:4] == [0, 1, 2, 3] and kept[4] == len(tokens) - 256 and len(kept) == 260  # 300 evictions of one slot
    exact = _exact_keys(model, [tokens[p] for p in kept])  # [H, n, D]
    cached = lm.cache.keys[0, :, : len(kept)].double()  # [H, n, D]
    cosine = torch.nn.functional.cosine_similarity(cached, exact, dim=-1)  # [H, n]
    assert float(cosine.min()) > 0.999, f"worst key cosine {float(cosine.min()):.4f}"
