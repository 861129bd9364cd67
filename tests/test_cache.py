"""Cache views: policies' contracts, O(1) rollback, rollback after eviction."""

from __future__ import annotations

import itertools
import pickle

import pytest
import torch

from specstack.batch import TokenBatch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from specstack import (CachedModel, CacheState, EvictionPolicy, FullCache, GatheringPolicy, Level, LevelStats, SpecstackError,
                       SpeculationStack, StreamingLLM)
from specstack.gather_ops import TORCH_GATHER, CompiledGather, load_gather_ops
from specstack.kvstore import KVStore
from specstack.policies import check_selection
from specstack.synthetic import SyntheticLM, greedy_decode

GATHERS = [pytest.param(TORCH_GATHER, id="torch"),
           pytest.param(load_gather_ops(), id="compiled", marks=pytest.mark.skipif(not isinstance(load_gather_ops(), CompiledGather), reason="no compiler here"))]


@settings(max_examples=300)
@given(st.integers(0, 8), st.integers(2, 32), st.integers(0, 64), st.integers(1, 8), st.integers(0, 31))
def test_streaming_keeps_sinks_and_the_most_recent_within_budget(sinks, window, n, incoming, reserve) -> None:
    policy = StreamingLLM(sinks=sinks, window=window, **({"reserve": reserve} if 1 <= reserve < window else {}))
    capacity = policy.capacity(10_000)
    assume(incoming <= capacity)
    state = CacheState(positions=torch.arange(n) * 2, capacity=capacity, incoming=incoming)
    keep = check_selection(policy, policy.select(state), state)
    assert keep.numel() <= capacity - incoming
    assert keep.tolist() == sorted(set(keep.tolist()))
    room = capacity - incoming
    assert keep[: min(sinks, n, room)].tolist() == list(range(min(sinks, n, room)))
    if n and keep.numel() > min(sinks, n):
        assert keep[-1] == n - 1  # the newest slot is always kept
    if n > room:  # an eviction leaves room for `reserve` more tokens, when the window has it
        assert keep.numel() <= min(sinks, n, room) + window - policy.reserve


def test_streaming_reserve_is_checked() -> None:
    assert StreamingLLM(window=256).reserve == 16 and StreamingLLM(window=6).reserve == 1
    with pytest.raises(SpecstackError, match="reserve 8 is not allowed with a window of 8"):
        StreamingLLM(window=8, reserve=8)


def test_streaming_evicts_once_every_reserve_tokens() -> None:
    """Hysteresis: a full window is cut to window - reserve, so drafting token by token evicts once
    per ``reserve`` tokens, not on every token (each eviction moves and re-rotates the whole window)."""
    target = SyntheticLM(vocab_size=16, seed=4, sharpness=2.0)
    draft = SyntheticLM(vocab_size=16, seed=5, base=target, noise=0.5)
    stack = SpeculationStack.build([Level(model=draft, policy=StreamingLLM(sinks=4, window=64)), Level(model=target, gamma=4)])
    lm = stack.top.drafter.lm
    keeps = []
    keep = lm.cache.keep
    lm.cache.keep = lambda slots: (keeps.append(slots.shape[-1]), keep(slots))
    prompt = [int(t) for t in torch.randint(0, 16, (100,), generator=torch.Generator().manual_seed(1))]
    result = stack.generate(prompt, 96)  # the prompt (100 tokens) is fed in chunks: a few evictions there too
    assert len(keeps) <= len(result.tokens) / 8, f"{len(keeps)} evictions for {len(result.tokens)} tokens"
    assert set(keeps[-3:]) == {4 + 64 - 16}  # sinks + window - reserve
    assert list(result.tokens) == greedy_decode(target, prompt, 96)


def test_rollback_is_a_pointer_move() -> None:
    model = SyntheticLM(vocab_size=120, seed=1)
    cache = model.new_cache(16)
    model.forward(TokenBatch.chain(list(range(100, 110)), 0, 1), cache)
    storage = cache.keys.data_ptr()
    cache.truncate(6)
    assert len(cache) == 6 and cache.keys.data_ptr() == storage
    assert cache.values[0, 0, 7, 0] == 107  # not erased: the rejected suffix is simply overwritten later


def test_cached_model_matches_fresh_computation_after_rollbacks() -> None:
    model = SyntheticLM(vocab_size=7, seed=3)
    lm = CachedModel(model, FullCache(), LevelStats(name="t"))
    rows = lm.logits([1, 2, 3, 4, 5], 2)
    assert torch.equal(rows[1], model.logits_for([1, 2, 3, 4, 5]))
    lm.logits([1, 2, 3, 6], 1)  # diverges at position 3: rolls back, feeds one token
    assert lm.stats.forward_tokens == 5 + 1
    assert torch.equal(lm.logits([1, 2, 3, 6, 0], 2)[0], model.logits_for([1, 2, 3, 6]))


def test_rollback_after_an_eviction() -> None:
    """Speculative tokens rejected after the policy evicted old ones roll back correctly."""
    model = SyntheticLM(vocab_size=7, seed=3)
    lm = CachedModel(model, StreamingLLM(sinks=2, window=6), LevelStats(name="t"))
    sequence = [1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 4]
    lm.logits(sequence, 1)
    assert len(lm.cache) <= 8
    kept_before = lm.cache.positions.tolist()
    lm.logits(sequence + [5, 6], 1)  # speculate two tokens (forcing another eviction)
    row = lm.logits(sequence + [0], 1)[0]  # they are rejected; a different token follows
    visible = [sequence[p] if p < len(sequence) else 0 for p in lm.cache.positions.tolist()]
    assert lm.cache.positions.tolist()[-1] == len(sequence)
    assert set(lm.cache.positions.tolist()[:2]) == {0, 1}  # sinks survived
    assert torch.equal(row, model.logits_for(visible))
    assert kept_before[0] == 0


def test_prefill_longer_than_the_window_is_fed_in_chunks() -> None:
    model = SyntheticLM(vocab_size=7, seed=3)
    lm = CachedModel(model, StreamingLLM(sinks=1, window=8), LevelStats(name="t"))
    lm.logits(list(range(7)) * 5, 3)
    assert lm.stats.forward_calls > 1 and len(lm.cache) <= 9


class Hoarder(EvictionPolicy):
    name = "hoarder"

    def capacity(self, max_length: int) -> int:
        return 4

    def select(self, state: CacheState) -> torch.Tensor:
        return torch.arange(state.positions.shape[0])  # keeps everything: breaks the budget


def test_a_policy_breaking_its_budget_is_named() -> None:
    lm = CachedModel(SyntheticLM(vocab_size=5), Hoarder(), LevelStats(name="t"))
    with pytest.raises(SpecstackError, match="cache policy 'hoarder' kept 4 slots but only 3 fit"):
        lm.logits([0, 1, 2, 3, 4], 1)


def _filled_store(length: int, gather=TORCH_GATHER) -> KVStore:
    """Two layers, three KV heads; every key and value encodes (layer, head, position)."""
    store = KVStore(layers=2, kv_heads=3, head_dim=1, capacity=16, dtype=torch.float32, gather_ops=gather)
    store.begin(torch.arange(length))
    for layer in range(2):
        code = 100 * layer + 10 * torch.arange(3)[:, None] + torch.arange(length)  # [H, T]
        store.write(layer, code[:, :, None].float(), code[:, :, None].float())
        store.accumulate_attention(layer, code.float())
    store.commit()
    return store


@pytest.mark.parametrize("gather", GATHERS)
def test_per_head_eviction_keeps_each_heads_slots_and_rolls_back_over_the_shared_tail(gather) -> None:
    store = _filled_store(10, gather)
    heavy = torch.tensor([[[0, 2], [1, 3], [0, 4]], [[5, 6], [0, 1], [2, 6]]])  # [L, H, 2]: differs per head
    slots = torch.cat([heavy, torch.tensor([7, 8, 9]).expand(2, 3, 3)], dim=-1)  # [L, H, 5]
    store.keep(slots)
    expected = 100 * torch.arange(2)[:, None, None] + 10 * torch.arange(3)[None, :, None] + slots  # [L, H, 5]
    assert torch.equal(store.keys[:, :, :5, 0], expected.float())
    assert torch.equal(store.attention_mass(), expected.float())  # the scores moved with their slots
    assert store.positions.tolist() == [-1, -1, 7, 8, 9] and store.horizon == 7
    store.truncate(9)  # reject the newest token: a pointer move over the shared tail
    assert len(store) == 4
    store.truncate(5)  # inside the per-head part: the view must start over
    assert len(store) == 0


@pytest.mark.parametrize("gather", GATHERS)
def test_per_head_eviction_moves_runs_onto_their_own_slots(gather) -> None:
    """Entries moved to the front of their own store, in place: runs of consecutive survivors that overlap where they
    land (slots 1-12 to 0-11), or land where they are (0-12), or jump (a head keeping slots 4-15)."""
    store = _filled_store(16, gather)
    heads = [list(range(1, 11)), list(range(10)), [0, *range(4, 13)], list(range(2, 12)), [0, 1, 2, *range(6, 13)], [0, 2, 3, 5, *range(7, 13)]]
    slots = torch.cat([torch.tensor(heads).view(2, 3, 10), torch.tensor([13, 14, 15]).expand(2, 3, 3)], dim=-1)  # [L, H, 13]
    store.keep(slots)
    expected = 100 * torch.arange(2)[:, None, None] + 10 * torch.arange(3)[None, :, None] + slots  # [L, H, 13]
    assert torch.equal(store.keys[:, :, :13, 0], expected.float()) and torch.equal(store.values[:, :, :13, 0], expected.float())
    assert torch.equal(store.attention_mass(), expected.float())


def test_per_head_selections_are_checked_row_by_row() -> None:
    state = CacheState(positions=torch.arange(10), capacity=8, incoming=2)
    unsorted = torch.tensor([[[0, 1, 9], [1, 0, 9]]])  # [1, 2, 3]; the second row is not ascending
    with pytest.raises(SpecstackError, match="not strictly ascending"):
        check_selection(FullCache(), unsorted, state)


class Everything(GatheringPolicy):
    """Gathers every committed entry: the simplest gathering view."""

    name = "everything"

    def gather(self, keys: torch.Tensor, queries: torch.Tensor) -> torch.Tensor:
        return torch.arange(keys.shape[2], device=keys.device)  # [K]


def test_a_one_token_prompt_under_a_gathering_level() -> None:
    """At a one-token prompt nothing is committed yet, so there is nothing to gather: the view is fed
    the token (the old code asked the full level for logits of an empty context and crashed)."""
    target = SyntheticLM(vocab_size=8, seed=1, sharpness=2.0)
    draft = SyntheticLM(vocab_size=8, seed=2, base=target, noise=0.3)
    levels = [Level(model=draft, policy=StreamingLLM(sinks=1, window=4)), Level(model=target, policy=Everything(), gamma=2),
              Level(model=target, gamma=3)]
    out = SpeculationStack.build(levels).generate([3], 8)
    assert list(out.tokens) == greedy_decode(target, [3], 8)


def test_logits_of_nothing_more_to_feed_or_of_no_tokens() -> None:
    model = SyntheticLM(vocab_size=7, seed=3)
    lm = CachedModel(model, FullCache(), LevelStats(name="t"))
    assert lm.logits([1, 2, 3], 0).shape == (0, 7) and len(lm.cache) == 3  # fed, no logits wanted
    assert lm.logits([1, 2, 3], 0).shape == (0, 7) and lm.stats.forward_calls == 1  # nothing left to feed
    with pytest.raises(SpecstackError, match=r"asked for the logits of the last 1 of 0 tokens") as error:
        lm.logits([], 1)
    assert "\n" not in str(error.value)


def chunked_slots(generator: torch.Generator, layers: int, heads: int, chunks: int, chosen: int, size: int) -> torch.Tensor:
    """[L, H, chosen * size] ascending slots: each (layer, head) its own ``chosen`` of ``chunks`` runs of ``size``."""
    rows = [torch.randperm(chunks, generator=generator)[:chosen].sort().values for _ in range(layers * heads)]  # each [chosen]
    return (torch.stack(rows)[..., None] * size + torch.arange(size)).view(layers, heads, chosen * size)  # [L, H, K]


@pytest.mark.parametrize("gather", GATHERS)
@pytest.mark.parametrize("dtype, runs", [(torch.float32, 1), (torch.float32, 4), (torch.bfloat16, 4)])
def test_a_per_head_gather_copies_each_heads_own_entries(gather, dtype, runs) -> None:
    """gather_from with slots [L, H, K]: entry (l, h, j) of the view is the source's (l, h, slots[l, h, j]), for
    keys and values, checked one by one against the source's buffers: single slots, and chunks of four (runs of
    consecutive slots, which the compiled copy moves as one block), with torch's gather and the compiled one."""
    source = KVStore(layers=3, kv_heads=2, head_dim=8, capacity=40, dtype=dtype, gather_ops=gather)
    source.begin(torch.arange(32))
    source.keys[:, :, :32] = torch.randn(3, 2, 32, 8, generator=torch.Generator().manual_seed(0))
    source.values[:, :, :32] = torch.randn(3, 2, 32, 8, generator=torch.Generator().manual_seed(1))
    source.commit()
    slots = chunked_slots(torch.Generator().manual_seed(2), 3, 2, 28 // runs, 6 if runs == 1 else 2, runs)  # [L, H, K]: 6 slots, or 2 chunks of 4
    count = slots.shape[-1]
    view = KVStore(layers=3, kv_heads=2, head_dim=8, capacity=10, dtype=dtype, gather_ops=gather)
    view.gather_from(source, slots, horizon=28)
    assert len(view) == count and view.horizon == 28
    for layer, head, j in itertools.product(range(3), range(2), range(count)):
        slot = int(slots[layer, head, j])
        assert torch.equal(view.keys[layer, head, j], source.keys[layer, head, slot])
        assert torch.equal(view.values[layer, head, j], source.values[layer, head, slot])


@pytest.mark.parametrize("gather", GATHERS)
def test_a_gather_of_a_slot_outside_the_source_raises(gather) -> None:
    """A slot past the source's buffers is an index error, not a read of another head's (or no one's) memory: the bad
    slot lies in layer 0 only, where slot 16 names layer 1's slot 0 of the buffers seen as rows."""
    source = KVStore(layers=2, kv_heads=1, head_dim=4, capacity=16, dtype=torch.float32, gather_ops=gather)
    view = KVStore(layers=2, kv_heads=1, head_dim=4, capacity=8, dtype=torch.float32, gather_ops=gather)
    for bad in (16, -1):
        slots = torch.tensor([[[0, 1, 2, bad]], [[0, 1, 2, 3]]])  # [L, H, K]
        with pytest.raises(IndexError):
            view.gather_from(source, slots, horizon=16)


def test_the_compiled_gather_is_loaded_again_where_a_model_is_unpickled() -> None:
    """A store's copy of the compiled gather pickles as a request to load it (a bench's worker gets its own)."""
    gather = load_gather_ops()
    if not isinstance(gather, CompiledGather):
        pytest.skip("no compiler here")
    again = pickle.loads(pickle.dumps(gather))
    assert isinstance(again, CompiledGather) and again.path == gather.path
