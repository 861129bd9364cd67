"""A draft vocabulary (``draft_vocab``, :mod:`specstack.draft_vocabulary`): a stack's draft model computes logits
for its R most frequent tokens only, and the output is still exactly the target's."""

from __future__ import annotations

import pytest
import torch

from specstack import Registry, SamplingConfig, SpecstackError
from specstack.batch import TokenBatch
from specstack.draft_vocabulary import coverage, read_token_rank, token_rank, with_draft_vocabulary, write_token_rank
from specstack.synthetic import SyntheticLM, greedy_decode
from specstack.testing import ALPHA, stack_pvalue
from specstack.testing.llama import random_llama

PROMPT = [1, 2, 3, 1, 2]
DRAFTING = ["naive", "speculative", "triforce", "streaming-hierarchy", "hierarchical", "triforce-hybrid", "sequoia", "triforce-tree"]


def test_a_token_ranking_orders_by_frequency_then_id_and_is_saved_beside_a_draft(tmp_path) -> None:
    tokens = torch.tensor([3, 1, 3, 2, 1, 3, 0])
    rank = token_rank(tokens, 6)
    assert rank.tolist() == [3, 1, 0, 2, 4, 5]
    assert coverage(rank, tokens, 2) == pytest.approx(5 / 7)
    write_token_rank(rank, tmp_path)
    assert torch.equal(read_token_rank(tmp_path), rank)
    assert read_token_rank(tmp_path / "elsewhere") is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_model_with_a_vocabulary_gives_those_logits_and_minus_infinity_elsewhere(dtype) -> None:
    """The vocabulary's logits are the LM head's columns for those tokens (in bf16 bit for bit; in fp32 up to the
    rounding of a product with fewer output columns: test_medusa's output_head test); the others are -inf; the
    model it came from is unchanged."""
    rows = torch.tensor([5, 0, 77, 3, 255])
    model = random_llama(dtype=dtype)
    small = model.with_vocabulary(rows)
    prompt = list(range(10, 30))
    whole = model.forward(TokenBatch.chain(prompt, 0, 3), model.new_cache(64))  # [3, V]
    part = small.forward(TokenBatch.chain(prompt, 0, 3), small.new_cache(64))  # [3, V]
    outside = torch.ones(model.vocab_size, dtype=torch.bool)
    outside[rows] = False
    assert torch.isneginf(part[:, outside]).all() and torch.isfinite(part[:, rows]).all()
    tolerance = 0.0 if dtype == torch.bfloat16 else 1e-5
    assert torch.allclose(part[:, rows], whole[:, rows], rtol=tolerance, atol=tolerance)
    assert model.vocabulary is None and torch.isfinite(whole).all()


def _ranked(vocab: int, seed: int, **options) -> SyntheticLM:
    return SyntheticLM(vocab_size=vocab, seed=seed, token_rank=torch.randperm(vocab, generator=torch.Generator().manual_seed(seed)), **options)


@pytest.mark.parametrize("name", DRAFTING)
def test_every_recipe_with_a_draft_model_drafts_from_its_vocabulary_and_keeps_greedy_output(name) -> None:
    """draft_vocab = R: the draft level's model emits only the draft's first R ranked tokens; the output is the
    target's greedy decoding. draft_vocab = 0 (the default) leaves the draft as it is."""
    registry = Registry.create()
    target = SyntheticLM(vocab_size=16, seed=1, sharpness=2.0)
    draft = _ranked(16, 2, base=target, noise=0.5)
    prompt = list(range(8)) * 3
    assert registry.stack_recipe(name).levels(registry, target=target, draft=draft)[0].model is draft
    levels = registry.stack_recipe(name).levels(registry, target=target, draft=draft, draft_vocab=6)
    assert levels[0].model.support == tuple(sorted(draft.token_rank[:6].tolist()))
    has = registry.stack_recipe(name).options()
    options = {"budget": 8, "chunk_size": 2} if "chunk_size" in has else {"budget": 16} if "budget" in has else {}  # a view of a 24-token prompt
    stack = registry.stack(name, target=target, draft=draft, draft_vocab=6, **options)
    assert list(stack.generate(prompt, 20).tokens) == greedy_decode(target, prompt, 20)


def test_sampled_output_with_a_draft_vocabulary_keeps_the_target_distribution() -> None:
    """The draft can never propose the tokens outside its two: the target's probability of them comes only from
    the residual max(p - q, 0) at a rejection."""
    sampling = SamplingConfig(temperature=0.8)
    target = SyntheticLM(vocab_size=4, seed=11, sharpness=1.5)
    draft = _ranked(4, 3, base=target, noise=0.3)
    stack = Registry.create().stack("naive", target=target, draft=draft, sampling=sampling, seed=3, draft_vocab=2, gamma=3)
    assert stack_pvalue(stack, target, sampling, PROMPT) > ALPHA


def test_bad_draft_vocabularies_are_one_line_errors() -> None:
    registry = Registry.create()
    target, draft = SyntheticLM(vocab_size=16, seed=1), _ranked(16, 2)
    for bad in (-1, 17, 2.5, "many", True):
        with pytest.raises(SpecstackError, match=f"draft_vocab {bad!r} is not allowed; use 0 \\(the whole vocabulary\\) or an integer from 1 to 16"):
            registry.stack("naive", target=target, draft=draft, draft_vocab=bad)
    with pytest.raises(SpecstackError, match="draft_vocab=4 needs a draft that carries a token ranking .*'SyntheticLM' has none: use draft_vocab=0"):
        registry.stack("triforce", target=target, draft=SyntheticLM(vocab_size=16, seed=2), draft_vocab=4)
    assert with_draft_vocabulary(draft, 16) is draft  # the whole vocabulary: the draft as it is
