"""Per-round bookkeeping is O(γ), never O(context) (issue 13): the shared token sequence, what a
level has seen of it, and prompt lookup's incremental n-gram index."""

from __future__ import annotations

import random
import statistics
import tracemalloc

import attrs
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from specstack import Level, PromptLookupDrafter, SamplingConfig, SpeculationStack, StreamingLLM
from specstack.ngrams import CANDIDATES, LOOKBACK
from specstack.kvstore import KVStore
from specstack.types import Capability, SeenTokens, TokenSequence, TokenView
from specstack_sequoia import TreeLookupDrafter

VOCAB = 32


@attrs.define(eq=False, kw_only=True)
class FreeLM:
    """A model whose forward costs next to nothing, so that what a round costs beyond it is bookkeeping.
    Its next token is a function of the last token; ``noise`` makes a draft deviate every few positions."""

    vocab_size: int = VOCAB
    max_length: int = 16_384
    device: torch.device = torch.device("cpu")
    capabilities: frozenset = frozenset(Capability) - {Capability.HIDDEN_STATES}
    tokenizer_id: str = "free"
    noise: int = 0

    def new_cache(self, capacity: int, *, relative_positions: bool = False) -> KVStore:
        return KVStore(layers=1, kv_heads=1, head_dim=1, capacity=capacity, dtype=torch.float32, device="cpu")

    def forward(self, batch, cache: KVStore) -> torch.Tensor:
        cache.begin(batch.positions)
        t = len(batch)
        cache.write(0, torch.zeros(1, t, 1, device="cpu"), torch.zeros(1, t, 1, device="cpu"))  # [H, T, D] each
        cache.commit()
        last, positions = batch.tokens[t - batch.num_logits :], batch.positions[t - batch.num_logits :]  # [num_logits] each
        following = (last * 7 + 3) % VOCAB
        if self.noise:
            following = torch.where(positions % self.noise == 0, (following + 1) % VOCAB, following)
        return torch.nn.functional.one_hot(following, VOCAB).float()  # [num_logits, V]


# -- the shared sequence --------------------------------------------------------------------------


def test_prefixes_are_views_read_in_place() -> None:
    sequence = TokenSequence([5, 6, 7, 8])
    view = sequence.view(4)
    assert isinstance(view[:2], TokenView) and len(view[:2]) == 2 and view[:-1].tolist() == [5, 6, 7]
    assert view[1:3] == [6, 7] and view[-1] == 8 and list(view) == [5, 6, 7, 8] and view[::-1] == [8, 7, 6, 5]
    assert np.asarray(view, dtype=np.int64).tolist() == [5, 6, 7, 8]  # what plugins do
    assert np.shares_memory(view.array(), sequence.view(2).array())
    with pytest.raises(IndexError):
        view[4]


def test_only_writes_that_alter_a_token_are_logged() -> None:
    sequence = TokenSequence([1, 2, 3])
    sequence.write(3, [4, 5])  # new positions
    sequence.write(1, [2, 3, 4])  # the same tokens again
    assert sequence.version == 0 and sequence.unchanged_since(0) > 5
    sequence.write(3, [9])
    assert sequence.version == 1 and sequence.unchanged_since(0) == 3 and sequence.view(5).tolist() == [1, 2, 3, 9, 5]
    with pytest.raises(ValueError, match="gap"):
        sequence.write(7, [1])


def test_a_view_of_rewritten_tokens_refuses_to_be_read() -> None:
    sequence = TokenSequence([1, 2, 3])
    view = sequence.view(3)
    sequence.write(3, [4])  # behind it: the view stays valid
    assert view.tolist() == [1, 2, 3]
    sequence.write(2, [0])
    with pytest.raises(RuntimeError, match="rewritten"):
        view.tolist()


def test_common_prefix_compares_only_past_the_point_it_verified() -> None:
    """White box: scribble over the seen tokens below the verified point; an O(γ) comparison does not
    look there again, and the sequence's change log says nothing changed there."""
    sequence = TokenSequence(list(range(10)))
    seen = SeenTokens()
    seen.extend(list(range(10)))
    assert seen.common_prefix(sequence.view(10)) == 10
    seen.array()[:8] = -1  # not a legitimate use: proves positions below 8 are not compared again
    sequence.write(10, [10, 11])
    seen.truncate(8)
    seen.extend([8, 9, 10])
    assert seen.common_prefix(sequence.view(12)) == 11
    sequence.write(9, [0])  # a rewrite below the verified point is in the change log
    assert seen.common_prefix(sequence.view(12)) == 9


@given(st.lists(st.tuples(st.sampled_from(["rewrite", "feed", "compare", "other"]), st.integers(0, 40),
                          st.lists(st.integers(0, 2), min_size=1, max_size=4)), max_size=40))
def test_common_prefix_equals_a_full_comparison(operations) -> None:
    """Random rewrites of the sequence, truncations and extensions of the seen tokens, views of other
    sequences: the O(γ) answer is always the brute-force one."""
    sequence, seen, mirror = TokenSequence([0, 1]), SeenTokens(), []
    for op, at, tokens in operations:
        if op == "rewrite":
            sequence.write(at % (len(sequence) + 1), tokens)
        elif op == "feed":
            seen.truncate(at)
            del mirror[at:]
            seen.extend(tokens)
            mirror.extend(tokens)
        other = [*mirror[:at], *tokens]
        view = TokenSequence(other).view(len(other)) if op == "other" else sequence.view(min(at, len(sequence)))
        expected = next((i for i, (a, b) in enumerate(zip(mirror, view.tolist())) if a != b), min(len(mirror), len(view)))
        assert seen.common_prefix(view) == expected


# -- a round's cost -------------------------------------------------------------------------------


def _stacks() -> dict[str, list[Level]]:
    return {
        "draft+streaming -> middle -> target": [Level(model=FreeLM(noise=5), policy=StreamingLLM(sinks=4, window=60)),
                                                Level(model=FreeLM(noise=13), gamma=4), Level(model=FreeLM(), gamma=6)],
        "prompt lookup -> target": [Level(drafter=PromptLookupDrafter(vocab=VOCAB)), Level(model=FreeLM(), gamma=6)],
        "lookup tree -> target": [Level(drafter=TreeLookupDrafter(vocab=VOCAB, branches=3)), Level(model=FreeLM(), gamma=6)],
        "priced lookup tree -> target": [Level(drafter=_priced(TreeLookupDrafter(vocab=VOCAB, branches=3))), Level(model=FreeLM(noise=5), gamma=6)],
    }


def _priced(drafter):
    drafter.price([1.0 + 0.1 * width for width in range(8)])  # a forward of 1, 2, … tokens
    return drafter


def _bytes_per_round(levels: list[Level], context: int) -> float:
    """The median, over top-level rounds, of the most Python memory a round had allocated at once."""
    stack = SpeculationStack.build(levels, sampling=SamplingConfig(temperature=0.0))
    prompt = torch.randint(0, VOCAB, (context,), generator=torch.Generator().manual_seed(0)).tolist()
    peaks, before = [], [0]

    def progress(done: int, total: int) -> None:
        peaks.append(tracemalloc.get_traced_memory()[1] - before[0])
        tracemalloc.reset_peak()
        before[0] = tracemalloc.get_traced_memory()[0]

    tracemalloc.start()
    try:
        before[0] = tracemalloc.get_traced_memory()[0]
        stack.generate(prompt, 48, progress=progress)
    finally:
        tracemalloc.stop()
    return statistics.median(peaks[1:])  # the first round includes the prompt


@pytest.mark.parametrize("name", list(_stacks()))
def test_a_round_allocates_nothing_that_grows_with_the_context(name) -> None:
    """Copying the context into a new list in a round ([*prefix, *tokens]) costs 8 bytes a token."""
    short, long = (_bytes_per_round(_stacks()[name], context) for context in (512, 6144))
    assert long - short < 0.5 * (6144 - 512), f"{short:.0f} bytes a round at 512 tokens, {long:.0f} at 6144"


# -- prompt lookup --------------------------------------------------------------------------------


def _scan(seq: np.ndarray, n: int, max_ngram: int = 3, min_ngram: int = 1, lookback: int = 0) -> list[int]:
    """The search prompt lookup did before it kept an index: a scan of the whole context per call. With ``lookback``,
    of the latest CANDIDATES occurrences the one whose tokens agree longest with the text's, counted token by token."""
    for size in range(min(max_ngram, len(seq) - 1), min_ngram - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(seq[:-1], size)  # [L-size, size]
        hits = np.flatnonzero((windows == seq[-size:]).all(axis=1))
        if hits.size:
            ends = [int(hit) + size - 1 for hit in hits[-CANDIDATES:]]
            end = ends[-1] if not lookback else max(ends, key=lambda e: (_agreement(seq, e, max(lookback, size)), e))
            return seq[end + 1 : end + 1 + n].tolist()
    return []


def _agreement(seq: np.ndarray, end: int, most: int) -> int:
    """How many tokens up to ``end`` equal the text's last ones, at most ``most``."""
    count = 0
    while count < most and end - count >= 0 and seq[end - count] == seq[len(seq) - 1 - count]:
        count += 1
    return count


@pytest.mark.parametrize("kind", ["random", "repetitive"])
@pytest.mark.parametrize("ngrams", [(3, 1), (2, 2), (4, 2)])
@pytest.mark.parametrize("lookback", [0, 5, LOOKBACK])
def test_the_incremental_index_proposes_what_the_scan_did(kind, ngrams, lookback) -> None:
    """A sequence that grows, rolls back and is rewritten, as a stack's is, plus plain lists."""
    rng = random.Random(f"{kind} {ngrams}")  # a string seed: the same sequence in every process
    pattern = [rng.randrange(50) for _ in range(23)]
    def token(i: int) -> int:
        return rng.randrange(6) if kind == "random" else (pattern[i % 23] if rng.random() > 0.05 else rng.randrange(50))
    drafter = PromptLookupDrafter(vocab=50, max_ngram=ngrams[0], min_ngram=ngrams[1], lookback=lookback)
    sequence = TokenSequence([token(0)])
    length = 1
    for step in range(400):
        back = rng.choice([0, 0, 0, 1, 3, 8])  # a rejection rewrites the tail
        length = max(1, length - back)
        grown = [token(length + i) for i in range(rng.randrange(1, 6))]
        view = sequence.write(length, grown)
        length = len(view)
        n = rng.randrange(1, 7)
        prefix = view if step % 10 else view.tolist()
        assert drafter.propose(prefix, n).tokens.tolist() == _scan(view.array(), n, *ngrams, lookback), f"step {step}"
    drafter.reset()  # a new generation: nothing of the old index survives
    assert drafter.propose([1, 2, 1, 2], 2).tokens.tolist() == _scan(np.array([1, 2, 1, 2]), 2, *ngrams, lookback)


def test_prompt_lookup_drafts_from_the_occurrence_that_agrees_longest() -> None:
    """The text copies the passage 7 8 9 1 2 3 4 4 5; its last three tokens 1 2 3 occurred last before 6 0. Prompt lookup
    drafts what followed the passage it copies (the tokens before that occurrence agree with the text's for six
    tokens, before the latest one for three); with lookback=0, what followed the latest occurrence (Saxena's rule).
    Fails where the latest occurrence is taken whatever the agreement."""
    copied = [7, 8, 9, 1, 2, 3, 4, 4, 5, 1, 2, 3, 6, 0, 7, 8, 9, 1, 2, 3]
    assert PromptLookupDrafter(vocab=16).propose(copied, 3).tokens.tolist() == [4, 4, 5]
    assert PromptLookupDrafter(vocab=16, lookback=0).propose(copied, 3).tokens.tolist() == [6, 0, 7]
    assert PromptLookupDrafter(vocab=16, lookback=2).propose(copied, 3).tokens.tolist() == [6, 0, 7]  # 3 tokens each, the latest


def test_prompt_lookup_compares_only_its_latest_occurrences() -> None:
    """A round compares at most CANDIDATES occurrences (its cost does not grow with the text): an older occurrence that
    agrees longer is not found beyond them. Fails where every occurrence is compared."""
    passage = [40, 41, 42, 1, 2, 3, 30]
    others = [token for i in range(CANDIDATES) for token in (20 + i % 10, 1, 2, 3, 10 + i % 10)]
    text = [*passage, *others, 40, 41, 42, 1, 2, 3]
    assert PromptLookupDrafter(vocab=50).propose(text, 1).tokens.tolist() == [10 + (CANDIDATES - 1) % 10]
    fewer = [*passage, *others[5:], 40, 41, 42, 1, 2, 3]  # CANDIDATES - 1 others: the passage is among the latest
    assert PromptLookupDrafter(vocab=50).propose(fewer, 1).tokens.tolist() == [30]
