"""The conformance suite: the contracts every registered component must keep.

It is parametrised over every component the registry finds — the built-ins and every installed
plugin — so a plugin author checks a new component with one line::

    pytest --pyargs specstack.testing.conformance -k my-policy

Cache policies: declarations are valid, non-complete policies accept ``budget``, selections respect
the room and the budget, are ascending and unique, keep declared sinks; a speculated suffix rolls
back cleanly after an eviction or a gather; a stack using the policy is greedy-lossless. Drafters:
drafts are well formed and a stack drafting with them is greedy-lossless (a drafter whose weights
are made for one model provides ``conformance_instance(vocab)``, an instance for the suite's
synthetic models; one that reads hidden states gets a channel to a synthetic level first). Verifiers: verdicts are
well formed; greedy verifiers follow the argmax, sampling verifiers emit the target's distribution
(chi-square). Stack recipes: each builds on synthetic models and decodes greedy-losslessly.

Everything runs on :mod:`specstack.synthetic` models (a real :class:`~specstack.kvstore.KVStore`
underneath), in seconds, with fixed seeds.
"""

from __future__ import annotations

import inspect
import random

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from specstack import (CachedModel, CachePolicy, CacheState, Capability, Drafter, EvictionPolicy, GatheringPolicy, Level,
                       LevelStats, Registry, SamplingConfig, SpecstackError, SpeculationStack, StreamingLLM, Verifier)
from specstack.policies import FullCache, check_selection
from specstack.registry import Kind
from specstack.synthetic import SyntheticLM, greedy_decode
from specstack.testing import chi_square_pvalue
from specstack.types import Draft

BUDGET = 32  # small enough that a few hundred synthetic tokens force evictions and gathers
VOCAB = 48
REJECTED = range(40, 48)  # token ids used only for speculated-then-rejected tokens


def _params(kind: Kind, where=lambda component: True) -> list:
    """Every registered component of ``kind`` (built-ins and installed plugins), as pytest params."""
    registry = Registry.create()
    components = [(name, registry.entry(kind, name).component) for name in registry.names(kind)]
    return [pytest.param(c, id=f"{kind.name.lower().replace('_', '-')}-{name}") for name, c in components if where(c)]


POLICIES = _params(Kind.CACHE_POLICY)
EVICTING = _params(Kind.CACHE_POLICY, lambda c: issubclass(c, EvictionPolicy) and not c.complete)  # complete: never full
GATHERING = _params(Kind.CACHE_POLICY, lambda c: issubclass(c, GatheringPolicy))


def small(policy_class: type[CachePolicy]) -> CachePolicy:
    """The policy at the suite's small budget (complete policies take their defaults)."""
    if policy_class.complete:
        return policy_class()
    return policy_class(budget=BUDGET)


def _prompt(length: int, seed: int, vocab: int = 40) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(length)]


# -- cache policies -------------------------------------------------------------------------------


@pytest.mark.parametrize("policy_class", POLICIES)
def test_policy_declarations(policy_class) -> None:
    assert issubclass(policy_class, (EvictionPolicy, GatheringPolicy)), "a cache policy is an EvictionPolicy or a GatheringPolicy"
    assert isinstance(policy_class.name, str) and policy_class.name
    assert set(policy_class.requires) <= set(Capability)
    policy_class()  # the defaults must be valid
    if not policy_class.complete:
        assert "budget" in inspect.signature(policy_class).parameters, "a policy that does not keep everything takes budget="


@pytest.mark.parametrize("policy_class", POLICIES)
def test_policy_rejects_a_zero_budget_with_a_one_line_error(policy_class) -> None:
    if policy_class.complete:
        pytest.skip("keeps everything: no budget")
    with pytest.raises(SpecstackError) as error:
        policy_class(budget=0)
    assert "\n" not in str(error.value) and "0" in str(error.value)


@pytest.mark.parametrize("policy_class", EVICTING)
@settings(max_examples=60, derandomize=True, deadline=None)
@given(over=st.integers(1, 100), incoming=st.integers(1, 8), seed=st.integers(0, 99))
def test_eviction_keeps_the_contract(policy_class, over, incoming, seed) -> None:
    policy = small(policy_class)
    capacity = policy.capacity(4096)
    assume(incoming <= capacity)
    n = capacity - incoming + over  # the core asks for a selection only when the cache is full
    generator = torch.Generator().manual_seed(seed)
    attention = torch.rand(2, 3, n, generator=generator) if Capability.ATTENTION_WEIGHTS in policy.requires else None  # [L, H, n]
    state = CacheState(positions=torch.arange(n), capacity=capacity, incoming=incoming, attention=attention)
    keep = check_selection(policy, policy.select(state), state)  # ascending, unique, in range, within room
    assert keep.shape[-1] <= getattr(policy, "budget", capacity), "kept more than the budget"
    rows = keep.reshape(-1, keep.shape[-1])
    sinks = min(getattr(policy, "sinks", 0), n, state.room)
    assert (rows[:, :sinks] == torch.arange(sinks)).all(), "declared sinks were evicted"
    if keep.dim() == 3 and keep.shape[-1]:
        assert (rows[:, -1] == n - 1).all(), "per-head rows must end in the same slots (the recent window, newest slot included)"


@pytest.mark.parametrize("policy_class", GATHERING)
@settings(max_examples=30, derandomize=True, deadline=None)
@given(context=st.integers(BUDGET, 200), seed=st.integers(0, 99))
def test_gathering_keeps_the_contract(policy_class, context, seed) -> None:
    policy = small(policy_class)
    generator = torch.Generator().manual_seed(seed)
    keys = torch.randn(2, 3, context, 8, generator=generator)  # [L, H, h, D]
    queries = torch.randn(2, 6, 8, generator=generator)  # [L, Hq, D]
    slots = policy.gather(keys, queries)
    assert slots.dim() in (1, 3) and slots.dtype == torch.long
    rows = slots.reshape(-1, slots.shape[-1])
    assert (rows[:, 1:] > rows[:, :-1]).all() and int(slots.min()) >= 0 and int(slots.max()) < context
    if Capability.SPARSE_ATTENTION in policy.requires:
        weights = torch.rand(3, 5, slots.shape[-1], generator=generator).softmax(-1)  # [H, T, n]
        allowed = policy.attend(weights)
        assert allowed.shape == weights.shape and allowed.dtype == torch.bool
        assert (allowed.sum(-1) <= BUDGET).all() and (allowed.sum(-1) >= 1).all(), "each query attends to 1..budget slots"
    else:
        assert slots.shape[-1] <= BUDGET, "gathered more than the budget"


@pytest.mark.parametrize("policy_class", POLICIES)
def test_rollback_after_eviction_or_gather(policy_class) -> None:
    """Speculate past an eviction or gather, reject, continue: nothing rejected stays visible."""
    model = SyntheticLM(vocab_size=VOCAB, seed=5)
    policy = small(policy_class)
    source = CachedModel(model, FullCache(), LevelStats(name="full")) if policy.gathers_from_full else None
    lm = CachedModel(model, policy, LevelStats(name=policy.name), channel=source.open_channel() if source else None)
    sequence = _prompt(150, seed=1)
    if source is not None:
        source.logits(sequence, 1)
    lm.logits(sequence, 1)
    speculated = list(REJECTED)
    lm.logits(sequence + speculated, len(speculated) + 1)  # evicts or gathers on the way
    row = lm.logits(sequence + [7], 1)[0]  # the speculated tokens were rejected
    held = lm.cache.values[0, 0, : len(lm.cache), 0].long().tolist()
    assert not set(held) & set(REJECTED), "a rejected token is still in the view"
    assert held[-1] == 7 and len(lm.cache) <= lm.capacity
    if Capability.SPARSE_ATTENTION not in policy.requires:
        assert torch.equal(row, model.logits_for(held)), "the logits do not come from the view's tokens"


@pytest.mark.parametrize("policy_class", POLICIES)
@settings(max_examples=6, derandomize=True, deadline=None)
@given(seed=st.integers(0, 999), gamma=st.integers(1, 6), three_levels=st.booleans())
def test_a_stack_using_the_policy_is_greedy_lossless(policy_class, seed, gamma, three_levels) -> None:
    target = SyntheticLM(vocab_size=VOCAB, seed=seed, sharpness=2.0)
    small_model = SyntheticLM(vocab_size=VOCAB, seed=seed + 1, base=target, noise=0.5)
    middle = Level(model=target, policy=small(policy_class), gamma=2)
    levels = [middle, Level(model=target, gamma=gamma)]
    if three_levels:
        levels.insert(0, Level(model=small_model, policy=StreamingLLM(sinks=2, window=16)))
    else:
        levels[0] = Level(model=target, policy=small(policy_class))
    prompt = _prompt(120, seed)
    out = SpeculationStack.build(levels).generate(prompt, 24)
    assert list(out.tokens) == greedy_decode(target, prompt, 24)


# -- drafters -------------------------------------------------------------------------------------


def _drafter(drafter_class) -> Drafter:
    """The drafter at the suite's vocabulary."""
    make = getattr(drafter_class, "conformance_instance", None)
    return make(VOCAB) if make is not None else drafter_class(vocab=VOCAB)


def _attached(drafter: Drafter, prefix: list[int]) -> Drafter:
    """A drafter that reads hidden states, given the channel of a synthetic level that scored ``prefix``."""
    if Capability.HIDDEN_STATES in drafter.requires:
        level = CachedModel(SyntheticLM(vocab_size=VOCAB, seed=3), FullCache(), LevelStats(name="level"))
        drafter.attach_hidden_states(level.open_hidden_channel())
        level.logits(prefix, 1)
    return drafter


@pytest.mark.parametrize("drafter_class", _params(Kind.DRAFTER))
def test_drafts_are_well_formed(drafter_class) -> None:
    prefix = _prompt(60, seed=2, vocab=6) * 2
    drafter = _attached(_drafter(drafter_class), prefix)
    assert isinstance(drafter, Drafter) and drafter.vocab_size == VOCAB
    for n in (1, 4):
        draft = drafter.propose(prefix, n)
        assert isinstance(draft, Draft) and draft.kind is drafter.draft_kind, "a drafter's drafts are of the kind it declares"
        assert len(draft.head(n + 1)) == len(draft), "a draft is at most n (+1) tokens deep"
        assert draft.probs.shape == (len(draft), VOCAB)
        assert torch.allclose(draft.probs.sum(-1), torch.ones(len(draft)))
        assert (draft.probs[torch.arange(len(draft)), draft.tokens] > 0).all(), "a drafted token has probability 0 under its own proposal"


@pytest.mark.parametrize("drafter_class", _params(Kind.DRAFTER))
def test_a_stack_drafting_with_it_is_greedy_lossless(drafter_class) -> None:
    target = SyntheticLM(vocab_size=VOCAB, seed=3, sharpness=2.0)
    prompt = _prompt(40, seed=3, vocab=6) * 3
    stack = SpeculationStack.build([Level(drafter=_drafter(drafter_class)), Level(model=target, gamma=4)])
    assert list(stack.generate(prompt, 30).tokens) == greedy_decode(target, prompt, 30)


# -- verifiers ------------------------------------------------------------------------------------


def _samples(verifier: Verifier, p: torch.Tensor, q: torch.Tensor, trials: int) -> list[int]:
    """The first token emitted in each of ``trials`` verifications of a fresh one-token draft from q."""
    generator = torch.Generator().manual_seed(0)
    first = []
    for _ in range(trials):
        token = torch.multinomial(q[0], 1, generator=generator)  # [1]
        verdict = verifier.verify(Draft(tokens=token, probs=q[:1]), p[:2], generator)  # p: [k+1, V]
        assert verdict.accepted in ((), (0,)) and 0 <= verdict.next_token < p.shape[-1]
        first.append(int(token) if verdict.accepted else verdict.next_token)
    return first


@pytest.mark.parametrize("verifier_class", _params(Kind.VERIFIER))
def test_verdicts_follow_the_target(verifier_class) -> None:
    verifier = verifier_class()
    assert isinstance(verifier, Verifier)
    generator = torch.Generator().manual_seed(1)
    q = torch.rand(2, 5, generator=generator).softmax(-1)  # [k, V]
    p = torch.rand(3, 5, generator=generator).softmax(-1)  # [k+1, V]
    try:
        verifier.check_sampling(SamplingConfig(temperature=1.0))
    except SpecstackError:  # a greedy verifier: p is one-hot
        onehot = torch.nn.functional.one_hot(p.argmax(-1), 5).float()  # [k+1, V]
        draft = Draft(tokens=onehot[:2].argmax(-1), probs=q)
        verdict = verifier.verify(draft, onehot, generator)
        assert verdict.accepted == (0, 1) and verdict.next_token == int(onehot[2].argmax()) and verdict.bonus
        wrong = Draft(tokens=(onehot[:2].argmax(-1) + 1) % 5, probs=q)
        verdict = verifier.verify(wrong, onehot, generator)
        assert verdict.accepted == () and verdict.next_token == int(onehot[0].argmax()) and not verdict.bonus
        return
    samples = _samples(verifier, p, q, trials=3000)
    exact = {token: float(p[0, token]) for token in range(5)}
    assert chi_square_pvalue(samples, exact) > 1e-4, "the first emitted token is not distributed as the target's p"


# -- stack recipes --------------------------------------------------------------------------------


@pytest.mark.parametrize("recipe", _params(Kind.STACK))
def test_a_recipe_builds_on_synthetic_models_and_is_greedy_lossless(recipe) -> None:
    target = SyntheticLM(vocab_size=VOCAB, seed=4, sharpness=2.0)
    draft = SyntheticLM(vocab_size=VOCAB, seed=5, base=target, noise=0.5)
    prompt = _prompt(700, seed=4)  # longer than the recipes' default budgets
    options = recipe.conformance_options(VOCAB) if recipe.conformance_options else {}
    stack = Registry.create().stack(recipe.name, target=target, draft=draft if recipe.needs_draft else None, **options)
    assert list(stack.generate(prompt, 16).tokens) == greedy_decode(target, prompt, 16)
