"""The sequoia plugin: tree shapes, tree drafters, the planner, and the tree stacks.

Losslessness is checked as elsewhere: greedy output equals the target's greedy decoding, and sampled
output passes a chi-square test against the exact distribution of 3-token continuations (1500
samples, p > 1e-4, fixed seeds). A drafter that lies about how its siblings were drawn fails the
same test.
"""

from __future__ import annotations

import functools
import itertools
import random

import attrs
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specstack import Level, Registry, SamplingConfig, SpecstackError, SpeculationStack, warp
from specstack.cli import main
from specstack.ngrams import CANDIDATES, LOOKBACK
from specstack.retrieval import Retrieval
from specstack.synthetic import SyntheticLM, greedy_decode
from specstack.testing import ALPHA, stack_pvalue
from specstack.types import DraftKind, TokenSequence
from specstack_sequoia import Costs, SequoiaDrafter, TreeLookupDrafter, TreeShape, TreeTable, best_tree, plan_tree
from specstack_sequoia import plugin
from specstack_sequoia.drafters import race

SMALL = {"budget": 16, "chunk_size": 4, "stride": 8}  # retrieval sized for prompts of a few dozen tokens


@pytest.fixture(scope="module")
def registry() -> Registry:
    return Registry.create(entry_points=False, plugins=[plugin])


# -- tree shapes -----------------------------------------------------------------------------------


@pytest.mark.parametrize(("spec", "parents"), [
    ("chain:3", (-1, 0, 1)),
    ("star:3", (-1, -1, -1)),
    ("binary:2", (-1, -1, 0, 0, 1, 1)),
    ("widths:2,1,1", (-1, -1, 0, 1, 2, 3)),
    ("widths:2/1/1", (-1, -1, 0, 1, 2, 3)),
    ("parents:-1,0,0,-1", (-1, 0, 0, -1)),
    (" binary:1 ", (-1, -1)),
])
def test_tree_specs_parse(device: str, spec: str, parents: tuple[int, ...]) -> None:
    shape = TreeShape.parse(spec)
    assert shape.parents == parents
    assert TreeShape.parse(shape.spec) == shape and TreeShape.parse(shape) is shape
    assert TreeShape.parse(list(parents)) == shape


def test_tree_shape_structure(device: str) -> None:
    shape = TreeShape.parse("widths:3,2")
    assert (shape.size, shape.depth, shape.nodes_per_depth) == (9, 2, (3, 6))
    assert shape.children_per_node == (3, 2, 2, 2, 0, 0, 0, 0, 0, 0)
    assert shape.children(-1) == (0, 1, 2) and shape.children(1) == (5, 6)
    assert shape.truncate(1) == TreeShape.star(3) and shape.truncate(5) == shape
    assert str(TreeShape.binary(3)) == "binary:3" and TreeShape.parse("widths:1,1").spec == "chain:2"
    assert TreeShape.parse("parents:-1,-1,1").spec == "parents:-1,-1,1"  # irregular: spelled out


@pytest.mark.parametrize("spec", ["", "chain", "chain:0", "star:-1", "binary:x", "widths:", "widths:2,0", "parents:0",
                                  "parents:-1,5", "tree:3", "chain:2,3", "binary:13", 4, None, ["a"]])
def test_bad_tree_specs_are_one_line_errors(device: str, spec: str) -> None:
    with pytest.raises(SpecstackError) as error:
        TreeShape.parse(spec)
    message = str(error.value)
    assert "\n" not in message and "not allowed" in message


def test_a_recipe_names_a_bad_tree(device: str, registry) -> None:
    target = SyntheticLM(device=device, vocab_size=8)
    with pytest.raises(SpecstackError, match="tree 'binary:0'|binary depth 0"):
        registry.stack("sequoia", target=target, draft=target, tree="binary:0")


# -- the planner -----------------------------------------------------------------------------------


def test_planner_reproduces_hand_computed_optima(device: str) -> None:
    # p = [0.5, 0.4], 3 nodes: two root children (0.5 + 0.4) and a child of the first (0.5 · 0.5)
    # = 1.15 beats a chain (0.5 + 0.25 + 0.125), a child of the second (1.1) and a forked chain (0.95).
    shape, accepted = best_tree([0.5, 0.4], size=3, depth=3)
    assert shape.parents == (-1, -1, 0) and accepted == pytest.approx(1.15)
    # p = [0.8, 0.1]: the chain 0.8 + 0.64 + 0.512 = 1.952 beats 0.8 + 0.1 + 0.64 = 1.54
    shape, accepted = best_tree([0.8, 0.1], size=3, depth=3)
    assert shape == TreeShape.chain(3) and accepted == pytest.approx(1.952)


def test_planner_picks_a_chain_when_the_first_child_is_always_right(device: str) -> None:
    shape, accepted = best_tree([0.999, 0.0005, 0.0005], size=6, depth=6)
    assert shape == TreeShape.chain(6) and accepted == pytest.approx(sum(0.999**k for k in range(1, 7)))


def test_planner_picks_a_star_when_depth_is_one(device: str) -> None:
    shape, accepted = best_tree([0.5, 0.3, 0.1], size=3, depth=1)
    assert shape == TreeShape.star(3) and accepted == pytest.approx(0.9)


def _expected(parents: tuple[int, ...], p: list[float]) -> float:
    """Σ over nodes of Π p_rank along the path (the positional acceptance model), by brute force."""
    reach = []
    for i, parent in enumerate(parents):
        rank = [j for j in range(i) if parents[j] == parent].__len__()
        prob = p[rank] if rank < len(p) else 0.0
        reach.append(prob * (reach[parent] if parent >= 0 else 1.0))
    return sum(reach)


@settings(max_examples=20)
@given(p=st.lists(st.floats(0.0, 1.0), min_size=1, max_size=3), size=st.integers(1, 5), depth=st.integers(1, 4))
def test_the_dynamic_program_finds_the_best_of_all_small_trees(device: str, p, size, depth) -> None:
    total = sum(p)
    p = [v / total for v in p] if total > 1 else p
    trees = [t for t in itertools.product(*[range(-1, i) for i in range(size)])
             if TreeShape(parents=t).depth <= depth and max(TreeShape(parents=t).children_per_node) <= len(p)]
    if not trees:
        with pytest.raises(SpecstackError, match="no tree"):
            best_tree(p, size, depth)
        return
    shape, accepted = best_tree(p, size, depth)
    assert accepted == pytest.approx(max(_expected(t, p) for t in trees), abs=1e-9)
    assert _expected(shape.parents, p) == pytest.approx(accepted, abs=1e-9) and shape.size == size and shape.depth <= depth


def test_hardware_aware_plan_trades_tokens_for_time(device: str) -> None:
    p = [0.6, 0.2, 0.1]
    flat = Costs(verify_sizes=(1, 8, 64), verify_seconds=(1.0, 1.0, 9.0), draft_seconds=0.1)  # verification is free up to 8 tokens
    plan = plan_tree(p, max_size=64, max_depth=8, costs=flat)
    assert plan.shape.size <= 8
    table = TreeTable.solve(p, 64, 8)
    assert plan.expected_accepted == pytest.approx(table.expected_accepted(plan.shape.size, plan.shape.depth))
    assert plan.tokens_per_second == pytest.approx((1 + plan.expected_accepted) / (plan.shape.depth * 0.1 + flat.verify(plan.shape.size)))
    best = max((1 + table.expected_accepted(n, d)) / flat.round_seconds(n, d) for n in range(1, 65) for d in range(1, 9)
               if table.expected_accepted(n, d) > -1)
    assert plan.tokens_per_second == pytest.approx(best)
    unbounded = plan_tree(p, max_size=12, max_depth=4)
    assert unbounded.shape.size == 12 and unbounded.tokens_per_second is None


@pytest.mark.parametrize("bad", [[], [1.2], [0.7, 0.6], [-0.1]])
def test_a_bad_acceptance_vector_is_named(device: str, bad) -> None:
    with pytest.raises(SpecstackError, match="acceptance vector"):
        best_tree(bad, 3, 2)


# -- the drafters ----------------------------------------------------------------------------------


def _drafter(shape: str, sampling: SamplingConfig, seed: int = 0, device: str = "cpu", **options) -> tuple[SequoiaDrafter, SyntheticLM]:
    target = SyntheticLM(device=device, vocab_size=6, seed=seed, sharpness=1.5)
    draft = SyntheticLM(device=device, vocab_size=6, seed=seed + 1, base=target, noise=1.0)
    lm = SpeculationStack.build([Level(model=draft, model_drafter=functools.partial(SequoiaDrafter, shape=shape, **options)),
                                 Level(model=target, gamma=4)], sampling=sampling, seed=seed).top.drafter
    return lm, draft


@pytest.mark.parametrize(("sampling", "options", "kind"), [
    (SamplingConfig(temperature=1.0), {}, DraftKind.TREE_WITHOUT_REPLACEMENT),
    (SamplingConfig(temperature=1.0), {"replacement": True}, DraftKind.TREE_WITH_REPLACEMENT),
    (SamplingConfig(temperature=1.0), {"deterministic": True}, DraftKind.TREE_DETERMINISTIC),
    (SamplingConfig(temperature=0.0), {}, DraftKind.TREE_DETERMINISTIC),
])
def test_sequoia_drafts_follow_the_shape_with_q_after_each_parent(device: str, sampling, options, kind) -> None:
    drafter, model = _drafter("widths:3,2", sampling, **options)
    prefix = [1, 2, 3]
    draft = drafter.propose(prefix, 5)
    assert draft.kind is kind and drafter.draft_kind is kind
    assert draft.parents.tolist() == list(TreeShape.parse("widths:3,2").parents)
    for i in range(len(draft)):
        path = draft.tokens[draft.path(i)[:-1]].tolist()
        logits = model.logits_for([*prefix, *path])
        assert torch.allclose(draft.probs[i], warp(logits, sampling))
    for node in (-1, *range(3)):
        siblings = draft.tokens[draft.children(node)].tolist()
        if kind is DraftKind.TREE_DETERMINISTIC:
            path = draft.tokens[draft.path(node)].tolist() if node >= 0 else []
            assert siblings == model.logits_for([*prefix, *path]).topk(len(siblings)).indices.tolist()
        elif kind is DraftKind.TREE_WITHOUT_REPLACEMENT:
            assert len(set(siblings)) == len(siblings)
    assert drafter.lm.stats.drafted == len(draft)
    assert drafter.propose(prefix, 1).parents.tolist() == [-1, -1, -1]  # n limits the depth


def test_sequoia_caps_children_at_the_support_and_stops_at_stop_tokens(device: str) -> None:
    drafter, _ = _drafter("widths:4,4", SamplingConfig(temperature=1.0, top_k=2))
    draft = drafter.propose([1, 2], 2)
    assert len(draft.children(-1)) == 2 and all(len(draft.children(c)) == 2 for c in draft.children(-1))
    stopping = attrs.evolve(drafter, stop_tokens=frozenset(range(6)))
    assert len(stopping.propose([1, 2], 2)) == 2  # every root child is a stop token: no grandchildren


def test_lookup_tree_merges_matches_into_a_trie(device: str) -> None:
    drafter = TreeLookupDrafter(vocab=10, max_ngram=2, branches=3)
    #           0  1  2  3  4  5  6  7  8  9 10 11 12
    prefix = [1, 2, 3, 4, 9, 1, 2, 3, 5, 7, 1, 2, 6, 8, 1, 2]
    draft = drafter.propose(prefix, 3)
    # matches of (1, 2), most recent first: → 6 8 1, → 3 5 7, → 3 4 9  (the last two share "3")
    assert draft.kind is DraftKind.TREE_DETERMINISTIC
    assert draft.tokens.tolist() == [6, 8, 1, 3, 5, 7, 4, 9]
    assert draft.parents.tolist() == [-1, 0, 1, -1, 3, 4, 3, 6]
    assert torch.equal(draft.probs.argmax(-1), draft.tokens) and torch.all(draft.probs.sum(-1) == 1)
    assert int(draft.depths().max()) < 3
    assert drafter.propose([1, 2, 3], 4).tokens.numel() == 0  # nothing repeats
    assert drafter.propose(prefix, 3).tokens.tolist()[:3] == [6, 8, 1]
    with pytest.raises(SpecstackError, match="branches 0"):
        TreeLookupDrafter(vocab=10, branches=0)


def _scan_trie(seq: list[int], n: int, max_ngram: int, branches: int, lookback: int) -> tuple[list[int], list[int]]:
    """(tokens, parents) of the trie a whole-text scan builds: for each n-gram length, longest first, of the latest
    CANDIDATES occurrences of the text's suffix, those agreeing longest with the text first (counted token by token,
    ties the latest), each continuation that adds a node, up to ``branches`` of them."""
    found: list[tuple[int, ...]] = []
    for size in range(min(max_ngram, len(seq) - 1), 0, -1):
        ends = [end for end in range(size - 1, len(seq) - 1) if seq[end + 1 - size : end + 1] == seq[len(seq) - size :]][-CANDIDATES:]
        agree = lambda end: next((k for k in range(max(lookback, size)) if end - k < 0 or seq[end - k] != seq[-1 - k]), max(lookback, size))
        for end in sorted(ends, key=lambda e: (agree(e) if lookback else 0, e), reverse=True):
            continuation = tuple(seq[end + 1 : end + 1 + n])
            if continuation and len(found) < branches and not any(seen[: len(continuation)] == continuation for seen in found):
                found.append(continuation)
    tokens, parents, nodes = [], [], {}
    for continuation in found:
        node = -1
        for token in continuation:
            if (node, token) not in nodes:
                nodes[node, token] = len(tokens)
                tokens.append(token)
                parents.append(node)
            node = nodes[node, token]
    return tokens, parents


@pytest.mark.parametrize("lookback", [0, 4, LOOKBACK])
@pytest.mark.parametrize("kind", ["random", "repetitive"])
def test_lookup_tree_index_proposes_what_a_scan_of_the_text_does(kind, lookback) -> None:
    """A text that grows, rolls back and is rewritten, as a stack's is: the tree from the incremental index equals the
    one a scan of the whole text builds. Fails where occurrences are taken in order of recency alone (lookback > 0)."""
    rng = random.Random(f"{kind} {lookback}")
    pattern = [rng.randrange(40) for _ in range(19)]
    def token(i: int) -> int:
        return rng.randrange(5) if kind == "random" else (pattern[i % 19] if rng.random() > 0.08 else rng.randrange(40))
    drafter = TreeLookupDrafter(vocab=40, max_ngram=3, branches=4, lookback=lookback)
    sequence = TokenSequence([token(0)])
    length = 1
    for step in range(300):
        length = max(1, length - rng.choice([0, 0, 1, 3, 7]))
        view = sequence.write(length, [token(length + i) for i in range(rng.randrange(1, 5))])
        length = len(view)
        n = rng.randrange(1, 6)
        draft = drafter.propose(view if step % 7 else view.tolist(), n)
        tokens, parents = _scan_trie(view.tolist(), n, 3, 4, lookback)
        assert (draft.tokens.tolist(), draft.parents.tolist() if tokens else []) == (tokens, parents), f"step {step}"


def test_lookup_tree_offers_the_copied_passage_first() -> None:
    """The text copies the passage 7 8 9 1 2 3 4 4 5; the latest occurrence of its last three tokens 1 2 3 came before
    6 0. The passage's continuation is the first branch, the latest occurrence's the second; with lookback=0, the other
    way round. Fails where branches are ordered by recency alone."""
    copied = [7, 8, 9, 1, 2, 3, 4, 4, 5, 1, 2, 3, 6, 0, 7, 8, 9, 1, 2, 3]
    assert TreeLookupDrafter(vocab=16, branches=2).propose(copied, 3).tokens.tolist() == [4, 4, 5, 6, 0, 7]
    assert TreeLookupDrafter(vocab=16, branches=2, lookback=0).propose(copied, 3).tokens.tolist() == [6, 0, 7, 4, 4, 5]
    with pytest.raises(SpecstackError, match="lookback -1 is not allowed"):
        TreeLookupDrafter(vocab=16, lookback=-1)


CHEAP_THREE = [1.0, 1.1, 1.2, 1.3, 9.0, 9.0, 9.0]  # a forward of 1, 2, … tokens: up to four cost little, more too much


def test_a_priced_lookup_tree_drafts_the_branch_the_text_follows() -> None:
    """Priced, the tree learns from the text written after each draft which of its branches the text follows. After
    1 2 3 the text goes on 4 6 (what followed the older occurrence, the second branch), never 7 9 (the latest, the
    first): unlearned, the three nodes drafted are the likeliest by the prior (7, 4 and 9); learned, the second
    branch's three (4 6 1). Fails where nothing is learned, or what is learned is credited to the wrong branch."""
    start = [5, 1, 2, 3, 4, 6, 1, 2, 3, 7, 9, 1, 2, 3]
    drafter = TreeLookupDrafter(vocab=10, branches=2, lookback=0)
    drafter.price(CHEAP_THREE)
    first = drafter.propose(start, 3)
    assert (first.tokens.tolist(), first.parents.tolist()) == ([7, 9, 4], [-1, 0, -1])
    for _ in range(40):  # the text goes on 4 6; then it is rolled back to start, as a rejection rolls a stack back
        drafter.propose([*start, 4, 6], 3)
        drafter.propose(start, 3)
    learned = drafter.propose(start, 3)
    assert (learned.tokens.tolist(), learned.parents.tolist()) == ([4, 6, 1], [-1, 0, 1])
    drafter.price([1.0, 9.0, 9.0, 9.0])  # priced anew: the chances start again, and no node pays
    assert drafter.propose(start, 3).tokens.numel() == 0


@pytest.mark.parametrize("costs", [CHEAP_THREE, [1.0, 1.05, 1.1, 1.15, 1.2, 1.25, 1.3, 1.35, 1.4]])
def test_a_priced_lookup_tree_is_greedy_lossless(device: str, costs) -> None:
    target = SyntheticLM(device=device, vocab_size=12, seed=3, sharpness=2.0)
    prompt = [random.Random(4).randrange(6) for _ in range(40)]
    drafter = TreeLookupDrafter(vocab=12, branches=3)
    drafter.price(costs)
    stack = SpeculationStack.build([Level(drafter=drafter), Level(model=target, gamma=4)])
    result = stack.generate(prompt, 40)
    assert list(result.tokens) == greedy_decode(target, prompt, 40)
    assert result.levels[-1].accepted > 0


def test_gamma_auto_prices_a_lookup_tree_and_raises_its_depth_to_max_gamma(monkeypatch, registry) -> None:
    """gamma=auto tells the lookup tree the target's forward costs and lets it draft as deep as max_gamma (its level's
    γ, the depth's cap: the tree chooses its nodes), as prompt lookup's chains may; the output stays the target's
    greedy decoding. Fails where the tree level keeps the recipe's depth (3)."""
    from specstack import autotune

    target = SyntheticLM(vocab_size=12, seed=3, sharpness=2.0)
    prompt = [random.Random(4).randrange(6) for _ in range(40)]
    stack = registry.stack("lookup-tree", target=target, gamma=3)
    monkeypatch.setattr(autotune, "_verify_costs", lambda level, context, widths, repeats, seed: {t: 1.0 + 0.05 * (t - 1) for t in widths})
    tuning = autotune.tune(stack, prompt, calibration_tokens=8, max_gamma=6)
    assert tuning.priced and tuning.gammas == (6,) == (autotune.verifying_levels(stack)[0].gamma,)
    assert "level 0 chooses each draft's nodes, γ1 their depth's cap" in tuning.describe()
    result = stack.generate(prompt, 40)
    assert list(result.tokens) == greedy_decode(target, prompt, 40)


def test_a_sampled_priced_lookup_tree_keeps_the_target_distribution(device: str) -> None:
    sampling = SamplingConfig(temperature=0.8, top_p=0.9)
    target = SyntheticLM(device=device, vocab_size=4, seed=31, sharpness=1.5)
    drafter = TreeLookupDrafter(vocab=4, branches=3)
    drafter.price(CHEAP_THREE)
    stack = SpeculationStack.build([Level(drafter=drafter), Level(model=target, gamma=3)], sampling=sampling, seed=7)
    assert stack_pvalue(stack, target, sampling, LOOKUP_PROMPT) > ALPHA
    assert stack.generate(LOOKUP_PROMPT, 24).levels[-1].accepted > 0


# -- greedy losslessness of the stacks -------------------------------------------------------------

SHAPES = ["star:3", "chain:3", "binary:2", "widths:3,2,1", "parents:-1,0,0,-1,2"]


@settings(max_examples=20)
@given(recipe=st.sampled_from(["sequoia", "triforce-tree", "lookup-tree"]), tree=st.sampled_from(SHAPES), seed=st.integers(0, 999),
       prompt_length=st.integers(24, 60), window=st.sampled_from([16, 128]), branches=st.integers(1, 3), stop=st.sampled_from([None, 0, 5]))
def test_tree_stacks_are_greedy_lossless(device: str, registry, recipe, tree, seed, prompt_length, window, branches, stop) -> None:
    vocab = 24
    target = SyntheticLM(device=device, vocab_size=vocab, seed=seed, sharpness=2.0)
    draft = SyntheticLM(device=device, vocab_size=vocab, seed=seed + 1, base=target, noise=0.5)
    rng = random.Random(seed)
    prompt = [rng.randrange(8) for _ in range(prompt_length)]  # a small alphabet: lookup finds matches
    options = {
        "sequoia": dict(tree=tree, draft_window=window, sinks=2),
        "triforce-tree": dict(tree=tree, draft_window=window, sinks=2, gamma2=4, **SMALL),
        "lookup-tree": dict(branches=branches, gamma=3),
    }[recipe]
    stops = () if stop is None else (stop,)
    stack = registry.stack(recipe, target=target, draft=draft if recipe != "lookup-tree" else None, stop_tokens=stops, **options)
    result = stack.generate(prompt, 20)
    assert list(result.tokens) == greedy_decode(target, prompt, 20, stop_tokens=stops)


def test_triforce_tree_verifies_the_tree_at_the_middle_level(device: str, registry) -> None:
    target = SyntheticLM(device=device, vocab_size=24, seed=1, sharpness=2.0)
    draft = SyntheticLM(device=device, vocab_size=24, seed=2, base=target, noise=0.5)
    stack = registry.stack("triforce-tree", target=target, draft=draft, tree="widths:2,2,1", **SMALL)
    middle = stack.top.drafter
    assert middle.gamma == 3 and middle.lm.policy.name == "retrieval" and middle.drafter.draft_kind is DraftKind.TREE_DETERMINISTIC
    prompt = list(range(8)) * 5
    result = stack.generate(prompt, 24)
    assert list(result.tokens) == greedy_decode(target, prompt, 24)
    assert result.levels[1].drafted > result.levels[1].rounds * 3  # trees, wider than a chain


# -- sampled losslessness --------------------------------------------------------------------------

PROMPT = [1, 2]
LOOKUP_PROMPT = [1, 2, 0, 1, 3, 1, 2, 2, 0, 1]  # repeats, so lookup proposes several branches


def _tree_level(draft: SyntheticLM, shape: str, **options) -> Level:
    return Level(model=draft, model_drafter=functools.partial(SequoiaDrafter, shape=shape, **options))


WARPS = {
    "t0.8": SamplingConfig(temperature=0.8),
    "top_k": SamplingConfig(temperature=0.8, top_k=3),
    "top_p": SamplingConfig(temperature=0.8, top_p=0.8),
}


KINDS = {"without": ({}, "sequoia"), "with": ({"replacement": True}, "specinfer"), "deterministic": ({"deterministic": True}, "token-tree")}


@pytest.mark.parametrize(("kind", "warp_name"), [("without", "t0.8"), ("without", "top_k"), ("without", "top_p"), ("with", "t0.8"),
                                                 ("with", "top_k"), ("deterministic", "t0.8"), ("deterministic", "top_p")])
def test_a_sampled_tree_keeps_the_target_distribution(device: str, kind, warp_name) -> None:
    (options, verifier), sampling = KINDS[kind], WARPS[warp_name]
    target = SyntheticLM(device=device, vocab_size=4, seed=11, sharpness=1.5)
    draft = SyntheticLM(device=device, vocab_size=4, seed=12, base=target, noise=1.0)
    stack = SpeculationStack.build([_tree_level(draft, "widths:3,2", **options), Level(model=target, gamma=2)], sampling=sampling, seed=3)
    assert stack.top.verifier.name == verifier
    assert stack_pvalue(stack, target, sampling, PROMPT) > ALPHA


@pytest.mark.parametrize("shape", ["star:3", "chain:3", "planned"])
def test_sampled_trees_of_every_shape_keep_the_target_distribution(device: str, shape) -> None:
    """Star, chain and the planner's own output (siblings without replacement, top-k and top-p)."""
    if shape == "planned":
        shape = best_tree([0.6, 0.25, 0.1], size=6, depth=3)[0].spec
    sampling = SamplingConfig(temperature=0.9, top_k=3, top_p=0.9)
    target = SyntheticLM(device=device, vocab_size=4, seed=51, sharpness=1.5)
    draft = SyntheticLM(device=device, vocab_size=4, seed=52, base=target, noise=1.0)
    stack = SpeculationStack.build([_tree_level(draft, shape), Level(model=target, gamma=3)], sampling=sampling, seed=5)
    assert stack_pvalue(stack, target, sampling, PROMPT) > ALPHA


@pytest.mark.parametrize(("options", "warp_name"), [({}, "t0.8"), ({"replacement": True}, "top_p"), ({"deterministic": True}, "top_k")],
                         ids=["without", "with", "deterministic"])
def test_a_tree_at_level_0_verified_by_the_middle_level_keeps_the_target_distribution(device: str, options, warp_name) -> None:
    sampling = WARPS[warp_name]
    target = SyntheticLM(device=device, vocab_size=4, seed=21, sharpness=1.5)
    middle = SyntheticLM(device=device, vocab_size=4, seed=22, base=target, noise=0.5)
    draft = SyntheticLM(device=device, vocab_size=4, seed=23, base=middle, noise=1.0)
    levels = [_tree_level(draft, "binary:3", **options), Level(model=middle, gamma=3), Level(model=target, gamma=3)]
    stack = SpeculationStack.build(levels, sampling=sampling, seed=5)
    assert stack_pvalue(stack, target, sampling, PROMPT) > ALPHA


def test_a_sampled_lookup_tree_keeps_the_target_distribution(device: str) -> None:
    sampling = SamplingConfig(temperature=0.8, top_p=0.9)
    target = SyntheticLM(device=device, vocab_size=4, seed=31, sharpness=1.5)
    stack = SpeculationStack.build([Level(drafter=TreeLookupDrafter(vocab=4, branches=3)), Level(model=target, gamma=3)], sampling=sampling, seed=7)
    assert stack.top.verifier.name == "token-tree"
    assert stack_pvalue(stack, target, sampling, LOOKUP_PROMPT) > ALPHA
    assert stack.generate(LOOKUP_PROMPT, 24).levels[-1].accepted > 0


def test_retrieval_middle_level_with_a_tree_keeps_the_target_distribution(device: str) -> None:
    sampling = SamplingConfig(temperature=0.8)
    target = SyntheticLM(device=device, vocab_size=4, seed=41, sharpness=1.5)
    draft = SyntheticLM(device=device, vocab_size=4, seed=42, base=target, noise=1.0)
    retrieval = Retrieval(budget=4, chunk_size=2, stride=2, reserve=16)
    levels = [_tree_level(draft, "widths:2,2"), Level(model=target, policy=retrieval, gamma=2), Level(model=target, gamma=3)]
    stack = SpeculationStack.build(levels, sampling=sampling, seed=9)
    assert stack_pvalue(stack, target, sampling, LOOKUP_PROMPT) > ALPHA


class LyingDrafter(SequoiaDrafter):
    """Deliberately wrong: draws siblings without replacement (the race) but declares them drawn
    with replacement, so SpecInfer's rule, which never renormalises q, verifies them.

    (The opposite lie, iid siblings declared as drawn without replacement, is harmless under the
    core's SequoiaVerifier: a repeat of a rejected sibling has q = 0 after renormalisation, is
    tried as one-hot and rejected with certainty without changing p or q, and any other token is
    distributed exactly as q with the rejected ones removed. So that lie cannot fail the test.)"""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.draft_kind = DraftKind.TREE_WITH_REPLACEMENT

    def _children(self, logits, q, count, position):
        return race(q, count, self.generator)


@pytest.mark.parametrize("seed", [3, 11])
def test_the_distribution_test_catches_a_drafter_lying_about_its_kind(device: str, seed) -> None:
    """A test of the test: q sharp on a token the target rarely wants, 3 siblings over 3 tokens.
    After the first sibling is rejected, SpecInfer's rule accepts the next ones against q instead of
    q without the rejected token, far too often."""
    sampling = SamplingConfig(temperature=1.0)
    target = SyntheticLM(device=device, vocab_size=3, seed=seed, sharpness=2.0)
    draft = SyntheticLM(device=device, vocab_size=3, seed=seed + 1, sharpness=3.0)
    lying = SpeculationStack.build([Level(model=draft, model_drafter=functools.partial(LyingDrafter, shape="star:3")),
                                    Level(model=target, gamma=1)], sampling=sampling, seed=seed)
    assert lying.top.verifier.name == "specinfer"
    assert stack_pvalue(lying, target, sampling, PROMPT) < ALPHA
    honest = SpeculationStack.build([_tree_level(draft, "star:3"), Level(model=target, gamma=1)], sampling=sampling, seed=seed)
    assert honest.top.verifier.name == "sequoia"
    assert stack_pvalue(honest, target, sampling, PROMPT) > ALPHA


# -- registration, the bench axis, the command -----------------------------------------------------


def test_the_plugin_registers_its_components(device: str, registry) -> None:
    from specstack.registry import Kind

    assert "lookup-tree" in registry.names(Kind.DRAFTER)
    assert {"sequoia", "triforce-tree", "lookup-tree", "triforce-lookup-tree"} <= set(registry.names(Kind.STACK))
    assert registry.command("plan-tree").name == "plan-tree"
    assert registry.stack_recipe("triforce-tree").options()["tree"] == "binary:2"


def test_the_trees_axis_crosses_only_stacks_with_a_tree_option(device: str, registry) -> None:
    from specstack.bench import Catalog, Grid, expand

    grid = Grid(stacks=["sequoia", "triforce-tree:tree=star:4", "speculative"], trees=["binary:2", "widths:4/2"])
    points = [p for group in expand(grid, Catalog(registry=registry), "synthetic") for p in group]
    trees = sorted((p.stack, dict(p.options).get("tree")) for p in points if p.stack != "autoregressive")
    assert trees == [("sequoia", "binary:2"), ("sequoia", "widths:4/2"), ("speculative", None), ("triforce-tree", "star:4")]
    with pytest.raises(SpecstackError, match="grid key 'trees'"):
        Grid(stacks=["sequoia"], trees=[3])


# -- the command -----------------------------------------------------------------------------------


def test_plan_tree_command_prints_a_tree(device: str, capsys) -> None:
    assert main(["plan-tree", "--synthetic", "--new-tokens", "32", "--max-size", "8", "--max-depth", "3", "--width", "4"]) == 0
    out = capsys.readouterr().out
    assert "positional acceptance p_1..p_4:" in out and "parents: " in out and "tokens/s" in out
    spec = out.split("-o tree=")[1].split()[0]
    assert 1 <= TreeShape.parse(spec).size <= 8 and TreeShape.parse(spec).depth <= 3


def test_plan_tree_command_rejects_a_bad_width(device: str, capsys) -> None:
    assert main(["plan-tree", "--synthetic", "--width", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--width 0" in err
