"""Defaults that fit any prompt length (budget="auto"), and the running chunk means behind retrieval.

The default stack (triforce) gathers about 1/16 of the context at every gather, keeps a context
shorter than two chunks whole, and so works from a one-token prompt up to the model's window. The
retrieval level reads chunk means the channel keeps running; its selection is the one the policy
made before, when it recomputed every mean at every gather.
"""

from __future__ import annotations

import io
import json
import sys

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from specstack import FullCache, Level, Registry, Retrieval, SpecstackError, SpeculationStack, StreamingLLM
from specstack.channels import FullCacheChannel, chunk_means
from specstack.cli import main
from specstack.retrieval import best_sorted
from specstack.model import CachedModel
from specstack.run import parse_options
from specstack.synthetic import SyntheticLM, greedy_decode
from specstack.types import LevelStats
from tests.test_real_model import models, prompt  # noqa: F401  (module-scoped fixtures: the embedded default)

RETRIEVAL_RECIPES = ["triforce", "triforce-hybrid", "triforce-lookup", "retrieval-flat", "self-speculative", "hierarchical"]


def _gather_before_auto(keys: torch.Tensor, queries: torch.Tensor, budget: int, chunk_size: int) -> torch.Tensor:
    """``Retrieval.gather`` before budget="auto" and running means (commit 455465a), as the reference."""
    layers, heads, context, dim = keys.shape
    chunks = context // chunk_size
    query = queries.reshape(layers, heads, -1, dim).float().mean(2)  # [L, H, D]
    scores = []
    for layer in range(layers):
        part = keys[layer, :, : chunks * chunk_size]  # [H, C*S, D]
        means = part.reshape(heads, chunks, chunk_size, dim).float().mean(2)  # [H, C, D]
        scores.append((means @ query[layer][..., None])[..., 0])  # [H, C]
    scores = torch.stack(scores)  # [L, H, C]
    scores[..., 0] = float("inf")
    tail = context - chunks * chunk_size
    best = scores.topk((budget - tail) // chunk_size, dim=-1).indices.sort(dim=-1).values  # [L, H, k]
    slots = (best[..., None] * chunk_size + torch.arange(chunk_size)).flatten(-2)  # [L, H, k*S]
    recent = torch.arange(chunks * chunk_size, context).expand(layers, heads, tail)  # [L, H, tail]
    return torch.cat([slots, recent], dim=-1)  # [L, H, K]


# -- budget="auto" ----------------------------------------------------------------------------------


def test_budget_auto_parses_as_a_stack_option() -> None:
    assert parse_options(["budget=auto", "budget_x=512"]) == {"budget": "auto", "budget_x": 512}


@pytest.mark.parametrize("name", RETRIEVAL_RECIPES)
def test_recipes_with_a_budget_default_to_auto(name) -> None:
    assert Registry.create().stack_recipe(name).options()["budget"] == "auto"


@pytest.mark.parametrize("budget", ["big", "Auto", 0, 100, 8, True, 512.0, -512])
def test_a_bad_budget_is_one_line_naming_it_and_what_is_allowed(budget) -> None:
    with pytest.raises(SpecstackError) as error:
        Retrieval(budget=budget)
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith(f"retrieval budget {budget!r} is not allowed with chunk_size 8; use a positive multiple of chunk_size")
    assert message.endswith("or 'auto'")


def test_auto_gathers_about_a_sixteenth_of_the_context_in_whole_chunks() -> None:
    policy = Retrieval()
    assert policy.budget == "auto"
    assert [policy.budget_for(n) for n in (4, 15, 16, 300, 2047, 7000, 8192)] == [4, 15, 16, 16, 128, 440, 512]
    assert policy.capacity(8192) == 512 + 8 + 32  # the 8K window bounds every gather; stride 8, reserve 32
    assert Retrieval(budget=256, chunk_size=8).capacity(8192) == 256 + 8 + 32


@given(
    window=st.integers(1, 9000), share=st.floats(0, 1), chunk_size=st.sampled_from([1, 2, 8, 16]),
    stride=st.integers(1, 64), reserve=st.integers(1, 32), seed=st.integers(0, 9),
)
def test_auto_never_gathers_more_than_the_capacity_leaves_room_for(window, share, chunk_size, stride, reserve, seed) -> None:
    """At any context the window allows: sorted, unique slots inside the context, the sink chunk and
    the incomplete last chunk kept, and the capacity fixed at build time still fits stride + reserve more."""
    policy = Retrieval(chunk_size=chunk_size, stride=stride, reserve=reserve)
    context = round(share * window)
    capacity = policy.capacity(window)
    budget = policy.budget_for(context)
    assert budget <= capacity - stride - reserve or capacity == window
    assert budget <= policy.budget_for(context + 1) and budget <= context
    means = torch.randn(1, 1, context // chunk_size, 4, generator=torch.Generator().manual_seed(seed))  # [L, H, C, D]
    slots = policy.gather_chunks(means, torch.randn(1, 2, 4), context)
    rows = slots.reshape(1, -1) if slots.dim() == 1 else slots.flatten(0, 1)  # [rows, K]
    assert slots.shape[-1] <= budget
    assert slots.shape[-1] + stride + reserve <= capacity or capacity == window
    assert (rows[:, 1:] > rows[:, :-1]).all() and (rows >= 0).all() and (rows < context).all()
    if context >= 2 * chunk_size:
        full = context - context % chunk_size
        assert (rows[:, :chunk_size] == torch.arange(chunk_size)).all(), "the sink chunk was dropped"
        assert (rows[:, rows.shape[1] - (context - full) :] == torch.arange(full, context)).all(), "the incomplete last chunk was dropped"


@pytest.mark.parametrize("context", [0, 1, 5, 15])
def test_auto_keeps_a_context_shorter_than_two_chunks_whole(context) -> None:
    slots = Retrieval().gather(torch.randn(2, 3, context, 8), torch.randn(2, 6, 8))
    assert slots.tolist() == list(range(context))


def test_an_explicit_budget_larger_than_the_context_keeps_its_error() -> None:
    with pytest.raises(SpecstackError, match=r"retrieval budget 512 is larger than the 300-token context; use a budget of at most 296, or 'auto'$"):
        Retrieval(budget=512).gather(torch.randn(2, 3, 300, 8), torch.randn(2, 6, 8))


def test_auto_on_a_named_policy_keeps_that_policys_own_budget() -> None:
    stack = Registry.create().stack("self-speculative", target=SyntheticLM(vocab_size=16, seed=0), policy="streaming")
    assert stack.top.drafter.lm.policy.window == StreamingLLM().window


@pytest.mark.parametrize("length", [1, 2, 5, 17, 40])
@pytest.mark.parametrize("name", ["triforce", "triforce-hybrid", "triforce-lookup", "retrieval-flat", "hierarchical"])
def test_default_stacks_are_lossless_at_any_prompt_length(name, length) -> None:
    target = SyntheticLM(vocab_size=24, seed=4, sharpness=2.0)
    draft = SyntheticLM(vocab_size=24, seed=5, base=target, noise=0.5)
    prompt = [(7 * i + 3) % 24 for i in range(length)]
    registry = Registry.create()
    stack = registry.stack(name, target=target, draft=draft if registry.stack_recipe(name).needs_draft else None)
    assert list(stack.generate(prompt, 12).tokens) == greedy_decode(target, prompt, 12)


# -- the channel: the empty context, running chunk means ---------------------------------------------


def _pair(model, policy) -> tuple[CachedModel, CachedModel]:
    source = CachedModel(model, FullCache(), LevelStats(name="full"))
    return source, CachedModel(model, policy, LevelStats(name="view"), channel=source.open_channel())


def test_an_empty_context_has_horizon_zero_and_feeds_nothing() -> None:
    """A one-token prompt: the gathering level's context before it is empty. The old channel asked
    the full cache for the logits of no tokens and failed (torch.cat of an empty list)."""
    source, view = _pair(SyntheticLM(vocab_size=16, seed=0), Retrieval())
    assert view.channel.horizon([]) == 0
    assert source.stats.forward_calls == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunk_means_are_the_same_bits_however_the_layers_are_split(dtype, monkeypatch) -> None:
    from specstack import channels

    keys = torch.randn(5, 3, 203, 16).to(dtype)  # [L, H, n, D]
    whole = chunk_means(keys, 8)  # [L, H, 25, D]
    monkeypatch.setattr(channels, "MEAN_BLOCK", 1)  # one layer at a time
    assert torch.equal(whole, chunk_means(keys, 8))
    assert torch.equal(whole, keys[:, :, :200].reshape(5, 3, 25, 8, 16).float().mean(3))


@given(seed=st.integers(0, 99), context=st.integers(48, 300), budget_chunks=st.integers(2, 12))
def test_selection_from_chunk_means_is_the_selection_before_on_random_keys(seed, context, budget_chunks) -> None:
    generator = torch.Generator().manual_seed(seed)
    keys = torch.randn(3, 2, context, 8, generator=generator)  # [L, H, n, D]
    queries = torch.randn(3, 6, 8, generator=generator)  # [L, Hq, D]
    budget = 4 * budget_chunks
    policy = Retrieval(budget=budget, chunk_size=4)
    assert torch.equal(policy.gather(keys, queries), _gather_before_auto(keys, queries, budget, 4))


def test_running_means_compute_only_new_chunks_and_follow_rollbacks_and_new_prompts() -> None:
    model = SyntheticLM(vocab_size=32, seed=2)
    source, view = _pair(model, Retrieval(budget=16, chunk_size=4))
    channel = view.channel
    sequence = [(5 * i + 1) % 32 for i in range(200)]
    source.logits(sequence[:100], 1)
    assert torch.equal(channel.chunk_means(4, 100), chunk_means(channel.keys(100), 4))
    first = channel._means.computed
    source.logits(sequence[:140], 1)  # 40 more tokens: 10 more chunks, nothing before them recomputed
    assert torch.equal(channel.chunk_means(4, 140), chunk_means(channel.keys(140), 4))
    assert channel._means.computed - first == 10
    source.logits([*sequence[:60], *[(t + 1) % 32 for t in sequence[60:150]]], 1)  # a rollback to 60, then other tokens
    assert torch.equal(channel.chunk_means(4, 150), chunk_means(channel.keys(150), 4))
    source.reset()
    source.logits(sequence[::-1][:150], 1)  # a new prompt of the same length
    assert torch.equal(channel.chunk_means(4, 150), chunk_means(channel.keys(150), 4))


def _catch_ups(monkeypatch, stack: SpeculationStack) -> list[int]:
    """Filled in as ``stack`` runs: at each gather, how many tokens before the context's last one the
    full-cache level lacked (more than 0: the gather made it run a forward of its own)."""
    behind = []
    horizon = FullCacheChannel.horizon

    def watched(channel, context):
        behind.append(len(context) - 1 - stack.top.lm.fed_prefix(context))
        return horizon(channel, context)

    monkeypatch.setattr(FullCacheChannel, "horizon", watched)
    return behind


def test_a_gather_due_to_the_stride_waits_for_the_full_level_to_hold_the_context(monkeypatch) -> None:
    """With room to spare, the view is gathered again only at the start of a round of the full level,
    so no gather makes that level run a forward of its own; the output stays the target's."""
    target = SyntheticLM(vocab_size=8, seed=5, sharpness=2.0)
    draft = SyntheticLM(vocab_size=8, seed=6, base=target, noise=1.0)
    policy = Retrieval(budget=8, chunk_size=2, stride=2, reserve=32)  # stride 2 < γ2 = 4: due in mid-round
    stack = SpeculationStack.build([Level(model=draft), Level(model=target, policy=policy, gamma=2), Level(model=target, gamma=4)])
    behind = _catch_ups(monkeypatch, stack)
    prompt = list(range(1, 8)) * 3
    result = stack.generate(prompt, 40)
    assert list(result.tokens) == greedy_decode(target, prompt, 40)
    assert result.levels[1].gathers >= 5 and max(behind) <= 0


# -- the embedded default -------------------------------------------------------------------------


class _CheckedRetrieval(Retrieval):
    """Retrieval whose every selection, made from the channel's running means, is compared with the
    selection of the old formula over the full cache's keys at that moment."""

    channel = None
    checked = 0

    def gather(self, keys: torch.Tensor, queries: torch.Tensor) -> torch.Tensor:
        return self.channel.gather(self, keys.shape[2])  # what CachedModel does once it gathers through the channel

    def gather_chunks(self, means: torch.Tensor, queries: torch.Tensor, context: int) -> torch.Tensor:
        slots = super().gather_chunks(means, queries, context)
        keys = self.channel.keys(context)  # [L, H, h, D]
        assert torch.equal(means, chunk_means(keys, self.chunk_size)), "a running mean is stale"
        assert torch.equal(slots, _gather_before_auto(keys, queries, self.budget_for(context), self.chunk_size))
        self.checked += 1
        return slots


@pytest.mark.real_model
def test_running_means_select_as_before_over_a_real_gather_sequence(models, prompt, monkeypatch) -> None:  # noqa: F811
    """TriForce on the embedded default: rejections roll the full cache back below gathered horizons,
    the channel's catch-up feeds speculative tokens into it (a small reserve runs out in mid-round:
    a gather due to the stride alone waits for the next round), and a second prompt replaces the first."""
    target, draft, _ = models
    policy = _CheckedRetrieval(budget=64, stride=8, reserve=2)
    levels = [Level(model=draft, policy=StreamingLLM(sinks=16, window=256)), Level(model=target, policy=policy, gamma=2), Level(model=target, gamma=6)]
    stack = SpeculationStack.build(levels)
    policy.channel = stack.top.drafter.lm.channel
    behind = _catch_ups(monkeypatch, stack)
    for text in (prompt[-400:], prompt[-300:]):
        stack.generate(text, 12)
    assert policy.checked >= 4
    assert max(behind) > 0  # a gather made the full level catch up


@pytest.mark.real_model
@pytest.mark.parametrize("length", [5, 2048])
def test_budget_auto_is_greedy_lossless_on_the_embedded_default(models, prompt, length) -> None:  # noqa: F811
    target, draft, _ = models
    registry = Registry.create()
    text = prompt[-length:]
    reference = registry.stack("autoregressive", target=target).generate(text, 8)
    result = registry.stack("triforce", target=target, draft=draft, budget="auto", stride=4).generate(text, 8)
    assert result.tokens == reference.tokens


@pytest.mark.real_model
@pytest.mark.parametrize(
    "argv",
    [["generate", "--max-new-tokens", "8"], ["generate", "--prompt", "hi", "--max-new-tokens", "8"]],
    ids=["stdin-four-tokens", "one-token-prompt"],
)
def test_a_new_users_first_commands_print_text(capsys, monkeypatch, argv) -> None:
    """The README's first commands with every default (stack triforce): a 4-token prompt failed on a
    retrieval budget of 512, a one-token prompt with a traceback from the channel."""
    monkeypatch.setattr(sys, "stdin", io.StringIO("It is a truth\n"))
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert captured.out.strip()
    assert "Traceback" not in captured.err and "error" not in captured.err


@pytest.mark.real_model
def test_a_bad_budget_on_the_command_line_is_one_line(capsys) -> None:
    assert main(["generate", "-o", "budget=big", "--prompt", "hi"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == ("specstack generate: error: retrieval budget 'big' is not allowed with chunk_size 8; "
                       "use a positive multiple of chunk_size, at least two chunks (16), or 'auto'")


@pytest.mark.real_model
def test_generate_coupled_samples_the_autoregressive_text_of_its_seed(capsys) -> None:
    """``--coupled`` at T = 0.7: prompt lookup and plain autoregressive decoding print the same sampled tokens for one
    seed (fp32), and another seed another text."""
    def tokens(*extra):
        argv = ["generate", "--book", "prideprejudice", "--prompt-tokens", "300", "--max-new-tokens", "16", "--temperature", "0.7",
                "--coupled", "--json", *extra]
        assert main(argv) == 0
        return json.loads(capsys.readouterr().out)["tokens"]

    lookup = tokens("--stack", "prompt-lookup", "--seed", "4")
    assert lookup == tokens("--stack", "autoregressive", "--seed", "4")
    assert lookup != tokens("--stack", "autoregressive", "--seed", "5")


@given(chunks=st.integers(1, 300), share=st.floats(0, 1), seed=st.integers(0, 99), nans=st.integers(0, 3), ties=st.booleans())
def test_the_best_chunks_are_the_highest_scores_in_ascending_order(chunks, share, seed, nans, ties) -> None:
    """best_sorted: each row's ``count`` indices ascending and distinct, and no score left out above one kept (NaN
    counting as highest, as torch.topk has it), with many equal scores too."""
    generator = torch.Generator().manual_seed(seed)
    scores = torch.randn(2, 3, chunks, generator=generator)  # [L, H, C]
    if ties:
        scores = scores.round()  # a few distinct values
    scores.view(-1)[torch.randperm(scores.numel(), generator=generator)[:nans]] = float("nan")
    count = max(1, round(share * chunks))
    best = best_sorted(scores, count)  # [L, H, count]
    assert best.shape == (2, 3, count) and best.dtype == torch.long
    assert (best[..., 1:] > best[..., :-1]).all()
    ranked = scores.nan_to_num(nan=float("inf"))  # [L, H, C]
    kept = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, best, True)  # [L, H, C]
    lowest_kept = ranked.masked_fill(~kept, float("inf")).amin(-1)  # [L, H]
    highest_left = ranked.masked_fill(kept, float("-inf")).amax(-1)  # [L, H]
    assert (highest_left <= lowest_kept).all()
    if not (ties or nans):  # distinct scores: torch's way (any dtype but float32) chooses the same
        assert torch.equal(best, best_sorted(scores.to(torch.float64), count))
