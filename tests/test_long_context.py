"""Long contexts: a window beyond the trained one through transformers' RoPE scaling, a chunked
prefill whose attention needs no [T, n] mask, and levels that must stay inside their model's window.

The fast tests use a tiny random-weight Llama (trained window 64); the last ones run the embedded
default beyond its 8K window.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from specstack import Registry, SpecstackError
from specstack.hf import HFCausalLM, _split_attention, window_config
from specstack.policies import StreamingLLM
from specstack.stack import Level, SpeculationStack

TRAINED = 64


@pytest.fixture
def tiny_dir(tmp_path):
    """A tiny Llama's config.json, trained window 64."""
    from transformers import LlamaConfig

    LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=TRAINED).save_pretrained(tmp_path)
    return str(tmp_path)


def tiny_model(tiny_dir: str, *, context: int | None = None, rope_scaling: str | None = None, seed: int = 0) -> HFCausalLM:
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    module = LlamaForCausalLM(window_config(tiny_dir, {}, context, rope_scaling))
    return HFCausalLM(module=module, tokenizer_id=None, name="tiny-llama")


# -- the window ----------------------------------------------------------------------------------------


def test_a_window_beyond_the_trained_one_needs_a_scaling_method(tiny_dir) -> None:
    with pytest.raises(SpecstackError, match=r"^context 256 is beyond the model's trained window of 64 tokens; allowed beyond it only with a RoPE scaling method: yarn or linear$"):
        window_config(tiny_dir, {}, 256, None)


@pytest.mark.parametrize("scaling", ["yarn", "linear"])
def test_scaling_goes_through_transformers_rope_parameters(tiny_dir, scaling) -> None:
    config = window_config(tiny_dir, {}, 256, scaling)
    assert config.max_position_embeddings == 256
    assert config.rope_parameters["rope_type"] == scaling
    assert config.rope_parameters["factor"] == 4.0
    assert config.rope_parameters["original_max_position_embeddings"] == TRAINED
    model = tiny_model(tiny_dir, context=256, rope_scaling=scaling)
    assert model.max_length == 256
    plain = tiny_model(tiny_dir)
    scaled, unscaled = model.module.model.rotary_emb.inv_freq, plain.module.model.rotary_emb.inv_freq
    if scaling == "linear":  # every frequency divided by the factor
        torch.testing.assert_close(scaled, unscaled / 4)
    else:  # YaRN keeps the fastest frequencies and interpolates the slowest
        assert scaled[0] == unscaled[0] and torch.isclose(scaled[-1], unscaled[-1] / 4)


def test_extrapolation_opens_the_window_with_rope_unchanged(tiny_dir) -> None:
    config = window_config(tiny_dir, {}, 256, "extrapolate")
    assert config.max_position_embeddings == 256
    assert config.rope_parameters["rope_type"] == "default"


def test_a_shorter_window_keeps_the_model_and_bounds_its_caches(tiny_dir) -> None:
    config = window_config(tiny_dir, {}, 32, "yarn")
    assert config.max_position_embeddings == 32
    assert config.rope_parameters["rope_type"] == "default"


@pytest.mark.parametrize("context, scaling, message", [
    (0, None, r"^context 0 is not allowed; use a number of tokens >= 1$"),
    ("long", None, r"^context 'long' is not allowed; use a number of tokens >= 1$"),
    (128, "ntk", r"^rope scaling 'ntk' is not allowed; use yarn, linear or extrapolate \(or none\)$"),
])
def test_bad_windows_are_one_line_errors(tiny_dir, context, scaling, message) -> None:
    with pytest.raises(SpecstackError, match=message):
        window_config(tiny_dir, {}, context, scaling)


def test_a_model_that_is_already_scaled_is_not_scaled_twice(tiny_dir) -> None:
    config = window_config(tiny_dir, {}, 128, "linear")
    config.save_pretrained(tiny_dir)  # now trained window 128, linear scaling inside
    with pytest.raises(SpecstackError, match=r"already uses RoPE scaling 'linear'"):
        window_config(tiny_dir, {}, 512, "yarn")


def test_a_scaled_target_decodes_past_its_trained_window_and_stops_at_the_new_one(tiny_dir) -> None:
    model = tiny_model(tiny_dir, context=128, rope_scaling="yarn")
    stack = Registry.create(entry_points=False).stack("autoregressive", target=model)
    assert len(stack.generate(list(range(1, 61)) * 2, 8).tokens) == 8  # positions up to 128
    with pytest.raises(SpecstackError, match=r"needs 129 positions but the model's window is 128"):
        stack.generate(list(range(1, 61)) * 2, 9)


def test_a_level_with_sequence_positions_stops_at_its_own_window(tiny_dir) -> None:
    """A draft with a full cache and a 64-token window cannot draft for a 128-token target at 80
    tokens; the same draft with StreamingLLM (positions are slots) can."""
    target = tiny_model(tiny_dir, context=128, rope_scaling="yarn")
    draft = tiny_model(tiny_dir, seed=1)
    prompt = [int(t) for t in torch.randint(1, 64, (80,), generator=torch.Generator().manual_seed(0))]
    full = SpeculationStack.build([Level(model=draft), Level(model=target, gamma=3)])
    with pytest.raises(SpecstackError, match=r"^level 'L0:full' reached position \d+, beyond its model's window of 64 tokens; "):
        full.generate(prompt, 8)
    streaming = SpeculationStack.build([Level(model=draft, policy=StreamingLLM(sinks=4, window=28)), Level(model=target, gamma=3)])
    reference = SpeculationStack.build([Level(model=target)]).generate(prompt, 8)
    assert streaming.generate(prompt, 8).tokens == reference.tokens


# -- chunked prefill -----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t, n", [(16, 17), (16, 300), (37, 100), (64, 64 + 5)])
def test_split_attention_is_causal_attention_aligned_to_the_last_key(dtype, t, n) -> None:
    generator = torch.Generator().manual_seed(t * n)
    query, key, value = (torch.randn(1, h, length, 16, generator=generator).to(dtype) for h, length in ((6, t), (2, n), (2, n)))
    expected = F.scaled_dot_product_attention(query.float(), key.float(), value.float(), attn_mask=causal_lower_right(t, n), enable_gqa=True)
    got = _split_attention(query, key, value, None)  # [1, T, Hq, D]
    tolerance = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(got.float(), expected.transpose(1, 2), **tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t, n", [(2, 40), (9, 100), (31, 32)])
def test_split_attention_with_a_tree_mask_is_attention_under_that_mask(dtype, t, n) -> None:
    """Among the new tokens, a token tree's ancestry (random parents); every cached key is visible."""
    generator = torch.Generator().manual_seed(t + n)
    parents = [int(torch.randint(-1, i, (), generator=generator)) if i else -1 for i in range(t)]
    sees = torch.eye(t, dtype=torch.bool)  # [T, T]
    for i, parent in enumerate(parents):
        if parent >= 0:
            sees[i] |= sees[parent]
    query, key, value = (torch.randn(1, h, length, 16, generator=generator).to(dtype) for h, length in ((6, t), (2, n), (2, n)))
    mask = torch.cat([torch.ones(t, n - t, dtype=torch.bool), sees], dim=1)  # [T, n]
    expected = F.scaled_dot_product_attention(query.float(), key.float(), value.float(), attn_mask=mask, enable_gqa=True)
    got = _split_attention(query, key, value, None, sees)  # [1, T, Hq, D]
    tolerance = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(got.float(), expected.transpose(1, 2), **tolerance)


def prefill_caches(model: HFCausalLM, prompt: list[int], chunk: int, progress=None):
    stack = SpeculationStack.build([Level(model=model)])
    stack.prefill_chunk = chunk
    result = stack.generate(prompt, 6, prefill_progress=progress)
    cache = stack.top.lm.cache
    return result, cache.keys[:, :, : len(prompt)].clone(), cache.values[:, :, : len(prompt)].clone()


def test_a_chunked_prefill_fills_the_cache_a_single_prefill_does(tiny_dir) -> None:
    model = tiny_model(tiny_dir, context=256, rope_scaling="yarn")
    prompt = [int(t) for t in torch.randint(1, 64, (200,), generator=torch.Generator().manual_seed(1))]
    calls = []
    whole, keys, values = prefill_caches(model, prompt, 1000)
    chunked, chunked_keys, chunked_values = prefill_caches(model, prompt, 48, progress=lambda done, total: calls.append((done, total)))
    assert calls == [(48, 200), (96, 200), (144, 200), (192, 200), (200, 200)]
    torch.testing.assert_close(chunked_keys, keys, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(chunked_values, values, atol=1e-5, rtol=1e-5)
    assert chunked.tokens == whole.tokens


# -- the embedded default beyond 8K ----------------------------------------------------------------------


@pytest.mark.real_model
def test_a_context_beyond_the_trained_window_needs_a_scaling_method_on_the_command_line(capsys) -> None:
    from specstack.cli import main

    assert main(["generate", "--prompt", "hi", "--context", "16384", "--rope-scaling", "none"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == ("specstack generate: error: context 16384 is beyond the model's trained window of 8192 tokens; "
                       "allowed beyond it only with a RoPE scaling method: yarn or linear")


@pytest.mark.real_model
def test_greedy_triforce_beyond_8k_equals_autoregressive_decoding() -> None:
    """fp32, YaRN to a 10K window, an 8.4K-token prompt: TriForce's output is the target's greedy output.
    TriForce takes the target's prefill from the reference (``share_prefill``, tested below to fill the
    cache a prefill does): its draft and retrieval levels prefill, the 8.4K-token target prefill runs once."""
    from specstack.data import book_tokens
    from specstack.models import load_default

    target, draft, tokenizer = load_default(context=10240, rope_scaling="yarn")
    prompt = book_tokens(tokenizer, 8400, name="persuasion")
    registry = Registry.create()
    autoregressive = registry.stack("autoregressive", target=target)
    reference = autoregressive.generate(prompt, 24)
    triforce = registry.stack("triforce", target=target, draft=draft)
    assert triforce.share_prefill(autoregressive, prompt)
    result = triforce.generate(prompt, 24, reuse_cache=True)
    assert result.tokens == reference.tokens
    assert result.levels[-1].forward_calls < reference.levels[-1].forward_calls  # it did speculate


# -- one prefill for several stacks ----------------------------------------------------------------------


def test_a_stack_that_shares_the_targets_prefill_decodes_as_if_it_had_prefilled(tiny_dir) -> None:
    target = tiny_model(tiny_dir, context=256, rope_scaling="yarn")
    draft = tiny_model(tiny_dir, seed=1)
    prompt = [int(t) for t in torch.randint(1, 64, (150,), generator=torch.Generator().manual_seed(2))]
    autoregressive = SpeculationStack.build([Level(model=target)])
    reference = autoregressive.generate(prompt, 12)

    def speculative():
        stack = SpeculationStack.build([Level(model=draft, policy=StreamingLLM(sinks=4, window=28)), Level(model=target, gamma=3)])
        stack.prefill_chunk = 48  # a prompt of several chunks: a shared prefill must not be fed again chunk by chunk
        return stack

    lone = speculative()
    alone = lone.generate(prompt, 12)
    stack = speculative()
    assert stack.share_prefill(autoregressive, prompt)
    shared = stack.generate(prompt, 12, reuse_cache=True)
    assert shared.tokens == alone.tokens == reference.tokens
    prefill_fed = stack.top.lm.stats.forward_tokens - shared.levels[-1].forward_tokens  # all it fed, less what decoding fed
    assert prefill_fed == 1  # the prompt's last token again, for its logits: the target level never prefilled
    n = len(prompt)
    for got, want in ((stack.top.lm.cache.keys, lone.top.lm.cache.keys), (stack.top.lm.cache.values, lone.top.lm.cache.values)):
        torch.testing.assert_close(got[:, :, :n], want[:, :, :n])  # [L, H, n, D]: the prompt's entries, as a prefill makes them


def test_only_a_complete_cache_of_the_same_model_is_shared(tiny_dir) -> None:
    target, other = tiny_model(tiny_dir), tiny_model(tiny_dir, seed=1)
    prompt = list(range(1, 40))
    autoregressive = SpeculationStack.build([Level(model=target)])
    autoregressive.generate(prompt, 2)
    assert not SpeculationStack.build([Level(model=other)]).share_prefill(autoregressive, prompt)
    assert not SpeculationStack.build([Level(model=target, policy=StreamingLLM(sinks=4, window=28))]).share_prefill(autoregressive, prompt)
    with pytest.raises(SpecstackError, match=r"holds 39 of the 50 tokens"):
        SpeculationStack.build([Level(model=target)]).share_prefill(autoregressive, list(range(1, 51)))


def test_each_level_reports_the_memory_of_its_kv_cache(tiny_dir) -> None:
    """Peak memory per level: the preallocated store (keys and values; a re-rotating draft also keeps
    its keys as written), the same before and after decoding."""
    from specstack.retrieval import Retrieval

    target = tiny_model(tiny_dir, context=256, rope_scaling="yarn")
    draft = tiny_model(tiny_dir, seed=1)
    stack = SpeculationStack.build([Level(model=draft, policy=StreamingLLM(sinks=4, window=28)),
                                    Level(model=target, policy=Retrieval(budget=32, chunk_size=4, stride=8, reserve=8), gamma=2),
                                    Level(model=target, gamma=3)])
    result = stack.generate([1 + i % 63 for i in range(100)], 6)
    per_slot = 2 * 2 * 8 * 4  # layers x KV heads x head dim x fp32 bytes, for keys or values
    assert [level.cache_bytes for level in result.levels] == [3 * 32 * per_slot, 2 * 48 * per_slot, 2 * 256 * per_slot]


def test_the_bf16_certificate_replays_the_prefill_in_the_stacks_chunks() -> None:
    """A prompt longer than a prefill chunk: the certificate's replay keys its cache chunk by chunk, as
    a stack's prefill did, so its logits for the first generated token are autoregressive decoding's
    bit for bit. One whole-prompt forward keys it with other bf16 roundings (the 32K demo's replay
    once refused a reference it had made that way)."""
    from specstack.model import CachedModel
    from specstack.policies import FullCache
    from specstack.stack import prefill_ends
    from specstack.testing.certificate import GreedyReference
    from specstack.testing.llama import random_llama
    from specstack.types import LevelStats

    target = random_llama(dtype=torch.bfloat16, layers=2)
    prompt = torch.randint(0, 256, (100,), generator=torch.Generator().manual_seed(0)).tolist()
    decoding = CachedModel(target, FullCache(), LevelStats(name="autoregressive"))
    for end in prefill_ends(len(prompt), 16):  # what SpeculationStack.generate does with prefill_chunk=16
        decoding.logits(prompt[:end], 1)
    first = decoding.logits(prompt, 1)[0]  # [V]: decoding feeds the prompt's last token again, alone
    tokens = [int(first.argmax())]
    assert prefill_ends(100, 16) == [16, 32, 48, 64, 80, 96, 100] and prefill_ends(100, 100) == [100]
    assert torch.equal(GreedyReference(target, prompt, tokens, prefill_chunk=16).logits(0), first)
    assert not torch.equal(GreedyReference(target, prompt, tokens, prefill_chunk=len(prompt)).logits(0), first)
