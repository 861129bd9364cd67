"""StreamingLLM with cache-relative positions: keys moved by compaction are re-rotated exactly.

With a one-layer model a key depends only on its token and rotary position, so after eviction the
cache must give the same logits as a fresh pass over the kept tokens placed at slots 0, 1, 2, …
"""

from __future__ import annotations

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
