"""Oracle tests on the embedded default: SmolLM2-135M-Instruct (target) and the shipped distilled draft.

Every stack's greedy output on a 2,048-token Pride and Prejudice prompt equals the target's own
greedy decoding, chain and token-tree stacks alike, Medusa heads included; sampled TriForce output follows the target's distribution on the first two
generated positions. The model is prepared by `make setup` (`specstack prepare`).
"""

from __future__ import annotations

import pytest
import torch

from specstack import Registry, SamplingConfig, SpecstackError, warp
from specstack.data import book_tokens
from specstack.hf import transformers_attention
from specstack.testing import chi_square_pvalue

pytestmark = pytest.mark.real_model

PROMPT_TOKENS = 2048
NEW_TOKENS = 40
SMALL = {"budget": 256, "chunk_size": 8, "stride": 16}  # retrieval scaled to a 2K prompt


@pytest.fixture(scope="module")
def models():
    from specstack.models import load_default

    target, draft, tokenizer = load_default()
    return target, draft, tokenizer


@pytest.fixture(scope="module")
def prompt(models):
    return book_tokens(models[2], PROMPT_TOKENS)


@pytest.fixture(scope="module")
def autoregressive(models):
    """The reference stack; once ``reference`` has run, its target level holds the prompt's cache."""
    return Registry.create().stack("autoregressive", target=models[0])


@pytest.fixture(scope="module")
def reference(autoregressive, prompt):
    return autoregressive.generate(prompt, NEW_TOKENS)


def generate(stack, autoregressive, prompt):
    """``stack``'s greedy output, with the target's prefill of the prompt copied from the reference
    (``share_prefill``, which fills the cache a prefill does: test_long_context), where ``stack``'s
    top level can take it: the levels below still prefill, and each test pays for one prefill less."""
    shared = stack.share_prefill(autoregressive, prompt)
    return stack.generate(prompt, NEW_TOKENS, reuse_cache=shared)


@pytest.mark.parametrize(
    ("name", "options"),
    [
        ("triforce", SMALL),
        ("triforce", {**SMALL, "draft_vocab": 8192}),  # the draft drafting from its 8,192 most frequent tokens
        ("naive", {}),
        ("retrieval-flat", SMALL),
        ("streaming-hierarchy", {"window": 256}),
        ("triforce-lookup", SMALL),
        ("triforce-hybrid", SMALL),  # prompt lookup where it matches, else the draft
        ("speculative", {"gamma": 4}),
        ("prompt-lookup", {}),
        ("self-speculative", {"policy": "h2o", "budget": 256}),  # the plugins at level 1
        ("self-speculative", {"policy": "topk-oracle", "budget": 256}),
        ("hierarchical", {"policy": "h2o", "budget": 256}),
        ("sequoia", {"tree": "binary:3"}),  # token trees (the sequoia plugin): a draft tree verified by the target
        ("sequoia", {"tree": "binary:3", "draft_vocab": 4096}),
        ("triforce-tree", {**SMALL, "tree": "widths:3,2,1"}),  # ... verified by the middle level over retrieval
        ("lookup-tree", {}),
        ("triforce-lookup-tree", SMALL),
        ("medusa", {"tree_size": 8}),  # Medusa heads (the medusa plugin) on the target's hidden state
        ("medusa-chain", {"tree_size": 8}),  # ... one head chained step after step (a tree expanded depth by depth)
        ("triforce-medusa", {**SMALL, "heads": "chained", "tree_size": 4}),
        ("triforce-medusa", {**SMALL, "tree_size": 4}),  # ... on the middle level's, over retrieval
        ("medusa-lookup", {"tree_size": 4}),  # ... prompt lookup's chain where it matches, else the chained heads' tree
        ("triforce-medusa-lookup", SMALL),  # ... that draft verified by the middle level over retrieval
    ],
)
def test_greedy_output_equals_the_targets_own_greedy_decoding(models, prompt, autoregressive, reference, name, options) -> None:
    target, draft, _ = models
    registry = Registry.create()
    extra = {"draft": draft} if registry.stack_recipe(name).needs_draft else {}
    result = generate(registry.stack(name, target=target, **extra, **options), autoregressive, prompt)
    assert result.tokens == reference.tokens
    top = result.levels[-1]
    assert top.rounds < NEW_TOKENS  # it really speculated: fewer target rounds than tokens
    if "stride" in options:  # the retrieval view was gathered again during decoding (stride 16)
        assert any(level.gathers for level in result.levels)


def test_retrieval_is_gathered_again_when_acceptance_drops(models, prompt, reference) -> None:
    """This stack prefills every level itself, so the module runs one stack's whole path too."""
    target = models[0]
    stack = Registry.create().stack("retrieval-flat", target=target, budget=256, stride=4096, refresh_below=0.99)
    result = stack.generate(prompt, NEW_TOKENS)
    assert result.tokens == reference.tokens
    assert result.levels[0].gathers >= 1  # no stride refresh can happen in 40 tokens: the acceptance drop did it


def test_greedy_reference_matches_transformers_generate(models, prompt, reference) -> None:
    """transformers' own SDPA attention and cache, not specstack's attention function."""
    target, _, _ = models
    ids = torch.tensor([prompt[-512:]])
    with transformers_attention([target.module], "sdpa"):
        assert target.module.config._attn_implementation == "sdpa"
        plain = target.module.generate(ids, max_new_tokens=8, do_sample=False)[0, 512:].tolist()
    ours = Registry.create().stack("autoregressive", target=target).generate(prompt[-512:], 8)
    assert list(ours.tokens) == plain


def test_sampled_triforce_follows_the_target_distribution(models, prompt) -> None:
    """Chi-square over (first, second) generated token pairs; exact probabilities from the target."""
    target, draft, _ = models
    sampling = SamplingConfig(temperature=0.8, top_k=4)
    short = prompt[-640:]
    stack = Registry.create().stack("triforce", target=target, draft=draft, sampling=sampling, seed=1, budget=128, stride=16)
    samples = [stack.generate(short, 2, reuse_cache=True).tokens for _ in range(300)]
    assert chi_square_pvalue(samples, _exact_pairs(target, short, sampling)) > 1e-4


def _exact_pairs(target, prompt, sampling) -> dict[tuple[int, int], float]:
    stack = Registry.create().stack("autoregressive", target=target)
    first = warp(stack.top.lm.logits(prompt, 1)[0], sampling)  # [V]
    exact = {}
    for x1 in torch.nonzero(first).flatten().tolist():
        second = warp(stack.top.lm.logits([*prompt, x1], 1)[0], sampling)  # [V]
        for x2 in torch.nonzero(second).flatten().tolist():
            exact[(x1, x2)] = float(first[x1] * second[x2])
    return exact


def test_retrieval_budget_larger_than_the_context_is_named(models, prompt) -> None:
    target, draft, _ = models
    stack = Registry.create().stack("triforce", target=target, draft=draft, budget=4096)
    with pytest.raises(SpecstackError, match="retrieval budget 4096 is larger than the 2047-token context"):
        stack.generate(prompt, 4)


def test_a_prompt_longer_than_the_window_is_named(models) -> None:
    target = models[0]
    with pytest.raises(SpecstackError, match="needs 8200 positions but the model's window is 8192"):
        Registry.create().stack("autoregressive", target=target).generate([1] * 8190, 10)


COUPLED = SamplingConfig(temperature=0.6, coupled=True)


@pytest.fixture(scope="module")
def coupled_reference(models, prompt):
    """Coupled autoregressive sampling at T = 0.6, seed 3, and its stack (whose cache then holds the prompt)."""
    stack = Registry.create().stack("autoregressive", target=models[0], sampling=COUPLED)
    return stack, stack.generate(prompt, NEW_TOKENS, seed=3)


@pytest.mark.parametrize(
    ("name", "options"),
    [("triforce", SMALL), ("prompt-lookup", {}), ("sequoia", {"tree": "binary:3"}), ("medusa-lookup", {"tree_size": 4})],
)
def test_coupled_sampling_writes_autoregressive_samplings_text(models, prompt, coupled_reference, name, options) -> None:
    """In fp32 a coupled stack's sampled output (T = 0.6) is coupled autoregressive sampling's with the same seed,
    token for token (tests/test_coupled.py checks it is distributed as the target's)."""
    target, draft, _ = models
    registry = Registry.create()
    extra = {"draft": draft} if registry.stack_recipe(name).needs_draft else {}
    reference_stack, reference = coupled_reference
    stack = registry.stack(name, target=target, sampling=COUPLED, **extra, **options)
    shared = stack.share_prefill(reference_stack, prompt)
    result = stack.generate(prompt, NEW_TOKENS, seed=3, reuse_cache=shared)
    assert result.tokens == reference.tokens
    assert result.levels[-1].rounds < NEW_TOKENS
