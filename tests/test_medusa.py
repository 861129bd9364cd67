"""The medusa plugin: hidden states through a channel, Medusa heads, their tree, and the medusa stacks.

Losslessness is checked as elsewhere: greedy output equals the target's greedy decoding, and sampled
output passes a chi-square test against the exact distribution of 3-token continuations (1500
samples, p > 1e-4, fixed seeds). The heads here are random (synthetic models have no text to learn):
they draft badly but must never change the output. A drafter that lies about how it drew its tokens
fails the same test, and the channel test fails if a level logs the hidden state of the wrong row.
"""

from __future__ import annotations

import pytest
import torch

from specstack import Level, Registry, SamplingConfig, SpecstackError, SpeculationStack
from specstack.cli import main
from specstack.synthetic import SyntheticLM, greedy_decode
from specstack.synthetic import sequence_probabilities
from specstack.testing import ALPHA, SAMPLES, chi_square_pvalue, stack_pvalue
from specstack.types import Capability, Draft, DraftKind
from specstack_medusa import MedusaDrafter, MedusaHeads, load_heads, plugin, save_heads
from specstack_medusa.heads import HeadsInfo, synthetic_heads
from specstack.speedup import paying_nodes, subtree_parents
from specstack_medusa.tree import DepthCalibration, RankTree, choose_paths, confident_nodes, parents_of, path_probabilities

SMALL = {"budget": 16, "chunk_size": 4, "stride": 8}  # retrieval sized for prompts of a few dozen tokens
PROMPT = [1, 2]


@pytest.fixture(scope="module")
def registry() -> Registry:
    return Registry.create(entry_points=False, plugins=[plugin])


HEADS = {"state": {}, "state+token": {"token_input": True}, "chained": {"chained": True}}  # the kinds of heads


def _medusa(vocab: int, *, tree_size: int = 8, kind: str = "state", **options) -> MedusaDrafter:
    return MedusaDrafter(vocab=vocab, heads=synthetic_heads(vocab, **HEADS[kind]), tree_size=tree_size, **options)


# -- the tree of candidates ------------------------------------------------------------------------


def test_the_tree_takes_the_likeliest_rank_paths_parents_first() -> None:
    paths = choose_paths([[0.6, 0.2], [0.5, 0.1]], size=4)  # products: 0.6, 0.3, 0.2, 0.1 (then 0.06, 0.02)
    assert paths == [(0,), (1,), (0, 0), (1, 0)]
    assert parents_of(paths) == [-1, -1, 0, 1]
    assert choose_paths([[1.0], [0.5, 0.0]], size=5) == [(0,), (0, 0)]  # a rank never right is never drafted
    assert len(choose_paths([[0.5] * 8] * 4, size=16)) == 16


def test_a_rank_tree_walks_its_paths_depth_by_depth() -> None:
    """RankTree: each node's depth, rank and parent; a depth's nodes; each node's parent as a row of the depth above
    (what a chained draft indexes its frontier with); the first depths alone; a subtree's parents renumbered."""
    tree = RankTree.of([(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)])
    assert (tree.depth, tree.rank, tree.parent) == ((0, 0, 1, 1, 1, 2), (0, 1, 0, 1, 0, 0), (-1, -1, 0, 0, 1, 2))
    assert [tree.at(d) for d in range(3)] == [range(0, 2), range(2, 5), range(5, 6)]
    assert [tree.slots(d) for d in range(3)] == [[0, 0], [0, 0, 1], [0]]  # node 5's parent, node 2, is depth 1's row 0
    assert tree.depths == 3 and len(tree.cut(2)) == 5 and tree.cut(2).depths == 2 and len(tree.cut(0)) == 0
    assert subtree_parents([0, 1, 4], list(tree.parent)) == [-1, -1, 1]


def test_confidence_keeps_the_nodes_whose_path_probability_is_high_enough() -> None:
    parents = [-1, -1, 0, 0, 1, 2]  # two roots; node 2 and 3 under 0, 4 under 1, 5 under 2
    probs = [0.8, 0.15, 0.5, 0.3, 0.9, 0.5]  # paths: 0.8, 0.15, 0.4, 0.24, 0.135, 0.2
    assert confident_nodes(probs, parents, 0.0) == [0, 1, 2, 3, 4, 5]
    assert confident_nodes(probs, parents, 0.2) == [0, 2, 3, 5]  # node 4's own 0.9 does not lift its parent's 0.15
    tree = Draft(tokens=torch.arange(6), probs=torch.ones(6, 6) / 6, parents=torch.tensor(parents), kind=DraftKind.TREE_DETERMINISTIC)
    assert tree.subtree(torch.tensor([0, 2, 3, 5])).parents.tolist() == [-1, 0, 0, 1]
    assert confident_nodes(probs, parents, 0.9) == []


@pytest.mark.parametrize("kind", list(HEADS))
def test_a_pruned_tree_is_a_subtree_of_the_full_one_and_keeps_greedy_output(kind: str) -> None:
    """min_prob drops the nodes the heads doubt (each node's probability of its own token, multiplied
    down its path) and renumbers the parents; the output is still the target's greedy decoding."""
    target = SyntheticLM(vocab_size=16, seed=1, sharpness=2.0)
    heads = synthetic_heads(16, **HEADS[kind])
    prompt = list(range(8)) * 3
    full, pruned = (MedusaDrafter(vocab=16, heads=heads, tree_size=8, min_prob=p) for p in (0.0, 0.1))
    for drafter in (full, pruned):
        SpeculationStack.build([Level(drafter=drafter), Level(model=target, gamma=drafter.step)]).generate(prompt, 1)
    whole, some = (d.propose(prompt + [3], d.step) for d in (full, pruned))
    node = whole.probs.gather(1, whole.tokens[:, None])[:, 0].tolist()
    kept = confident_nodes(node, whole.parents.tolist(), 0.1)
    assert 0 < len(kept) < len(whole)  # these random heads are sure of some nodes and not of others
    assert torch.equal(some.tokens, whole.tokens[kept]) and some.parents.tolist() == whole.subtree(torch.tensor(kept)).parents.tolist()
    stack = SpeculationStack.build([Level(drafter=pruned), Level(model=target, gamma=pruned.step)])
    assert list(stack.generate(prompt, 30).tokens) == greedy_decode(target, prompt, 30)
    doubted = MedusaDrafter(vocab=16, heads=heads, tree_size=8, min_prob=0.99)
    stack = SpeculationStack.build([Level(drafter=doubted), Level(model=target, gamma=doubted.step)])
    result = stack.generate(prompt, 10)
    assert list(result.tokens) == greedy_decode(target, prompt, 10) and result.levels[0].drafted == 0  # plain steps


def test_sampled_medusa_with_pruned_trees_keeps_the_target_distribution() -> None:
    sampling = SamplingConfig(temperature=0.8)
    target = SyntheticLM(vocab_size=4, seed=11, sharpness=1.5)
    drafter = MedusaDrafter(vocab=4, heads=synthetic_heads(4, chained=True), tree_size=6, min_prob=0.1)
    stack = SpeculationStack.build([Level(drafter=drafter), Level(model=target, gamma=drafter.step)], sampling=sampling, seed=3)
    assert stack_pvalue(stack, target, sampling, PROMPT) > ALPHA


# -- priced trees ---------------------------------------------------------------------------------


def test_the_paying_nodes_are_the_likeliest_as_many_as_pay() -> None:
    """Nodes by their chance of acceptance, not by tree order: node 2 (0.6, under node 0) before node 1 (0.3). At
    costs 1, 1.2, 1.3, 2.0 a second node pays and a third does not (1.5, 1.85, 1.35 tokens a second); a parent ranks
    before its equally likely child; only the nodes offered are taken."""
    reach = [0.8, 0.3, 0.6, 0.1]  # parents -1, -1, 0, 0
    assert paying_nodes(reach, [0, 1, 2, 3], [1.0, 1.2, 1.3, 2.0, 2.0]) == [0, 2]
    assert paying_nodes(reach, [0, 1, 2, 3], [1.0] * 5) == [0, 1, 2, 3]
    assert paying_nodes(reach, [0, 1, 2, 3], [1.0, 2.0, 3.0, 4.0, 5.0]) == []
    assert paying_nodes(reach, [0, 1], [1.0] * 5) == [0, 1]
    assert paying_nodes([0.5, 0.2, 0.5], [0, 1, 2], [1.0, 1.2, 2.0, 3.0]) == [0]  # node 2 (under 0) ties with it
    assert path_probabilities([0.8, 0.15, 0.5], [-1, -1, 0]) == pytest.approx([0.8, 0.15, 0.4])


def test_the_calibration_learns_each_depth_and_keeps_a_child_below_its_parent() -> None:
    """Rounds that accept the depth-0 node and never one at depth 1: depth 0's chances rise toward 1 and depth 1's
    fall toward 0, each from the same path probability; a child is never given more than its parent, even where its
    depth's ratio is higher; a depth priced out moves back toward 1. Fails where the depths share one ratio, where a
    child can outrank its parent, or where a verdict is learnt from without a draft shown."""
    calibration = DepthCalibration(weight=0.1, retry=0.02)
    path, depths, parents = [0.5, 0.5], [0, 1], [-1, 0]  # a chain of two nodes
    assert calibration.reach(path, depths, parents) == [0.5, 0.5]
    for _ in range(50):
        calibration.show(path, depths, [0, 1])
        calibration.observe(1)  # the first node accepted, the second not
    deep = calibration.reach([0.5, 0.5, 0.5], [0, 1, 1], [-1, -1, 0])
    assert deep[0] > 0.9 and deep[1] < 0.1 and deep[2] < 0.1
    before = calibration.reach([0.5], [1], [-1])
    calibration.observe(0)  # nothing shown since: nothing learnt
    assert calibration.reach([0.5], [1], [-1]) == before
    calibration.priced_out({1})
    assert calibration.reach([0.5], [1], [-1])[0] > before[0]
    for _ in range(50):
        calibration.show([0.9, 0.1], depths, [0, 1])
        calibration.observe(2)  # both accepted: depth 1's ratio (about 10) far above depth 0's (about 1.1)
    top = calibration.reach([0.5], [0], [-1])[0]
    assert top < 1.0 and calibration.reach([0.5, 0.5], depths, parents) == [top, top]  # the child capped at its parent


def _drafting(drafter: MedusaDrafter, prompt: list[int]) -> SpeculationStack:
    """A stack over ``drafter`` that has run one token, so that the drafter holds a state to draft from."""
    target = SyntheticLM(vocab_size=drafter.vocab, seed=1, sharpness=2.0)
    stack = SpeculationStack.build([Level(drafter=drafter), Level(model=target, gamma=drafter.step)])
    stack.generate(prompt, 1)
    return stack


def test_a_priced_medusa_drafter_drafts_what_pays_and_learns_how_often_it_is_right() -> None:
    """Told forward costs of 0.1 step a node, it drafts the subtree paying_nodes picks from the heads' path
    probabilities; after rounds in which nothing it drafted was accepted it drafts fewer nodes, then none; rounds priced
    out move its calibration back until it drafts again; after rounds in which every draft was accepted to its depth, it drafts at
    least as much as at first. Fails where observe does not learn, where a priced-out round does not move the
    calibration back, or where pricing is ignored."""
    drafter = MedusaDrafter(vocab=16, heads=synthetic_heads(16, token_input=True), tree_size=8, min_prob=0.0)
    prompt = list(range(8)) * 3
    _drafting(drafter, prompt)
    after = prompt + [3]
    whole = drafter.propose(after, drafter.step)
    costs = [1.0 + 0.1 * m for m in range(9)]
    assert drafter.price(costs)
    node = whole.probs.gather(1, whole.tokens[:, None])[:, 0].tolist()
    chosen = paying_nodes(path_probabilities(node, whole.parents.tolist()), list(range(len(whole))), costs)
    assert 0 < len(chosen) < len(whole)  # these random heads are sure enough of some nodes and not of others
    first = drafter.propose(after, drafter.step)
    assert torch.equal(first.tokens, whole.tokens[chosen])
    sizes = []
    for _ in range(80):  # nothing accepted
        draft = drafter.propose(after, drafter.step)
        drafter.observe(len(draft), 0)
        sizes.append(len(draft))
    assert sizes[0] == len(first) and max(sizes[40:]) < len(first)  # fewer nodes pay
    assert 0 in sizes[40:] and sum(sizes[40:]) > 0  # priced out, and tried again
    for _ in range(60):  # everything accepted down to the draft's depth
        draft = drafter.propose(after, drafter.step)
        drafter.observe(len(draft), int(draft.depths().max()) + 1 if len(draft) else 0)
    assert len(drafter.propose(after, drafter.step)) >= len(first)


def test_gamma_auto_prices_a_medusa_tree_and_keeps_greedy_output(monkeypatch) -> None:
    """gamma=auto tells the heads the target's forward costs: the level's γ becomes max_gamma, a cap on the tree's depth
    (the heads' trees are no deeper than their step), the description says the drafter chooses each draft's nodes, and
    the output is still the target's greedy decoding."""
    from specstack import autotune

    drafter = MedusaDrafter(vocab=16, heads=synthetic_heads(16, chained=True), tree_size=8, min_prob=0.0)
    target = SyntheticLM(vocab_size=16, seed=1, sharpness=2.0)
    stack = SpeculationStack.build([Level(drafter=drafter), Level(model=target, gamma=drafter.step)])
    monkeypatch.setattr(autotune, "_verify_costs", lambda level, context, widths, repeats, seed: {t: 1.0 + 0.1 * (t - 1) for t in widths})
    prompt = list(range(8)) * 3
    tuning = autotune.tune(stack, prompt, calibration_tokens=8, max_gamma=4)
    assert tuning.priced and tuning.gammas == (4,) and drafter.step <= 4
    assert "level 0 chooses each draft's nodes" in tuning.describe()
    assert list(stack.generate(prompt, 30).tokens) == greedy_decode(target, prompt, 30)


def test_sampled_medusa_lookup_priced_keeps_the_target_distribution(registry) -> None:
    """``medusa-lookup`` with both parts priced (prompt lookup's chains and the heads' trees each cut to what pays,
    each learning from the verdicts on its own drafts across the samples): chi-square at T = 0.8."""
    sampling = SamplingConfig(temperature=0.8)
    target = SyntheticLM(vocab_size=4, seed=11, sharpness=1.5)
    stack = registry.stack("medusa-lookup", target=target, heads=synthetic_heads(4, token_input=True), tree_size=6, sampling=sampling, seed=3,
                           min_ngram=1, min_prob=0.0)
    merged = stack.top.drafter
    assert merged.price([1.0 + 0.25 * m for m in range(9)])
    lookup, heads = merged.parts
    prompt = [1, 2, 3, 1, 2]
    exact = sequence_probabilities(target, prompt, 3, sampling)
    drawn = [stack.generate(prompt, 3, reuse_cache=True).tokens for _ in range(SAMPLES)]
    assert lookup.stats.drafted > 0 and heads.stats.drafted > 0
    assert chi_square_pvalue(drawn, exact) > ALPHA


def test_heads_round_trip_through_a_file_and_bad_files_are_one_line(tmp_path) -> None:
    heads = synthetic_heads(12, token_input=True)
    heads.info = HeadsInfo(hidden_size=8, heads=3, vocab_size=12, token_input=True, accuracy=[[0.5, 0.1], [0.3, 0.1], [0.2, 0.1]])
    save_heads(tmp_path / "h.safetensors", heads)
    loaded = load_heads(tmp_path / "h.safetensors")
    assert loaded.info == heads.info
    states, after = torch.randn(5, 8), torch.randn(5, 8)
    assert torch.equal(loaded(states, after), heads(states, after))
    with pytest.raises(SpecstackError, match="read the embedding of the token after each state"):
        loaded(states)
    (tmp_path / "bad.safetensors").write_bytes(b"not a heads file")
    for path, message in [(tmp_path / "none.safetensors", "does not exist"), (tmp_path / "bad.safetensors", "is not a medusa heads file")]:
        with pytest.raises(SpecstackError, match=message) as error:
            load_heads(path)
        assert "\n" not in str(error.value)


def test_heads_for_another_model_are_refused_in_one_line() -> None:
    with pytest.raises(SpecstackError, match="vocabulary of 12 tokens but the target has 16"):
        MedusaDrafter(vocab=16, heads=synthetic_heads(12))
    wide = SyntheticLM(vocab_size=12, seed=1, hidden_size=16)
    with pytest.raises(SpecstackError, match="hidden states of size 8 but the level they draft for has 16"):
        SpeculationStack.build([Level(drafter=MedusaDrafter(vocab=12, heads=synthetic_heads(12))), Level(model=wide, gamma=4)])
    flat = SyntheticLM(vocab_size=12, seed=1, capabilities=frozenset(Capability) - {Capability.HIDDEN_STATES})
    with pytest.raises(SpecstackError, match="drafter 'medusa' at level 1 needs hidden_states"):
        SpeculationStack.build([Level(drafter=MedusaDrafter(vocab=12, heads=synthetic_heads(12))), Level(model=flat, gamma=4)])


def test_bad_medusa_options_are_one_line_errors(capsys) -> None:
    assert main(["generate", "--stack", "medusa", "-o", "tree_size=0", "--prompt", "x"]) == 2
    assert capsys.readouterr().err.strip().endswith("medusa tree_size 0 is not allowed; use an integer >= 1")
    assert main(["generate", "--stack", "medusa", "-o", "heads=/no/such/heads.safetensors", "--prompt", "x"]) == 2
    assert "medusa heads file '/no/such/heads.safetensors' does not exist" in capsys.readouterr().err
    assert main(["generate", "--stack", "medusa", "-o", "min_prob=1", "--prompt", "x"]) == 2
    assert capsys.readouterr().err.strip().endswith("medusa min_prob 1 is not allowed; use a number from 0 (keep every node) up to but not including 1")


# -- the hidden-state channel ----------------------------------------------------------------------


def test_the_hidden_log_is_a_ring_of_recent_positions() -> None:
    from specstack.channels import HiddenLog

    log = HiddenLog(room=4)
    log.record(torch.arange(6), torch.arange(6.0)[:, None].expand(6, 3))  # positions 0-5 into 4 slots: 2-5 stay
    assert log.at(1) is None and [float(log.at(p)[0]) for p in range(2, 6)] == [2.0, 3.0, 4.0, 5.0]
    log.forget_from(4)  # a forward rewrote positions 4 on
    assert log.at(4) is None and log.at(5) is None and float(log.at(3)[0]) == 3.0
    held = log.at(3)
    log.record(torch.tensor([7]), torch.full((1, 3), 7.0))  # slot 3 now holds position 7
    assert log.at(3) is None and float(held[0]) == 3.0  # a state handed out is a copy


class Recording(MedusaDrafter):
    """Records, at every draft, the hidden state the channel hands over and the prefix it was for."""

    seen: list

    def propose(self, prefix, n: int) -> Draft:
        found = self._channel.latest(prefix)
        if found is not None:
            self.seen.append((list(prefix), *found))
        return super().propose(prefix, n)


@pytest.mark.parametrize("middle", [False, True], ids=["under-target", "under-retrieval"])
def test_the_channel_hands_the_state_of_the_last_committed_position(middle: bool) -> None:
    """The state a drafter reads for a prefix is the level's hidden state after exactly the tokens up
    to its position q, and q is one of the last two positions (a level logging the wrong row fails)."""
    from specstack import Retrieval

    target = SyntheticLM(vocab_size=10, seed=1, sharpness=2.0)
    drafter = Recording(vocab=10, heads=synthetic_heads(10), tree_size=6)
    drafter.seen = []
    levels = [Level(drafter=drafter), Level(model=target, gamma=drafter.step)]
    if middle:
        levels.insert(1, Level(model=target, policy=Retrieval(**SMALL), gamma=drafter.step))
    prompt = list(range(10)) * 4
    SpeculationStack.build(levels).generate(prompt, 40)
    assert len(drafter.seen) > 10
    for prefix, q, state in drafter.seen:
        assert q in (len(prefix) - 1, len(prefix) - 2)
        if not middle:  # a retrieval level sees part of the context: its states are its own
            assert torch.equal(state, target.hidden_for(prefix[: q + 1]))


def test_after_the_prefill_the_lm_head_drafts_the_next_token() -> None:
    """Right after the prompt the level holds the state of its last token, so the drafter reads q =
    len(prefix) - 1: the output head itself drafts the next token (head 0), the heads the ones after."""
    target = SyntheticLM(vocab_size=10, seed=1, sharpness=2.0)
    drafter = Recording(vocab=10, heads=synthetic_heads(10), tree_size=6)
    drafter.seen = []
    SpeculationStack.build([Level(drafter=drafter), Level(model=target, gamma=drafter.step)]).generate(list(range(10)), 1)
    prefix, q, state = drafter.seen[0]
    assert q == len(prefix) - 1


class RecordingTokens(MedusaDrafter):
    """Records, at every draft, the prefix, the position q of the state read and the token the heads read."""

    seen: list

    def propose(self, prefix, n: int) -> Draft:
        self._prefix = list(prefix)
        return super().propose(prefix, n)

    def _head_states(self, state, after):
        found = self._channel.latest(self._prefix)
        self.seen.append((self._prefix, found[0], after, super()._head_states(state, after)))
        return self.seen[-1][-1]


def test_heads_with_token_input_read_the_token_after_the_state() -> None:
    """Heads with token input read x_{q+1}: the prefix's last token when the state is of the one before
    (a drafter handing them another token fails), else, right after the prefill, the level's own greedy
    choice; and they read its embedding, so another token gives other head states."""
    target = SyntheticLM(vocab_size=10, seed=1, sharpness=2.0)
    drafter = RecordingTokens(vocab=10, heads=synthetic_heads(10, token_input=True), tree_size=6)
    drafter.seen = []
    SpeculationStack.build([Level(drafter=drafter), Level(model=target, gamma=drafter.step)]).generate(list(range(10)) * 3, 30)
    assert len(drafter.seen) > 5
    for prefix, q, after, _ in drafter.seen:
        assert (after == prefix[q + 1]) if q == len(prefix) - 2 else (after is None and q == len(prefix) - 1)
    assert drafter.seen[0][2] is None  # right after the prefill
    prefix, q, after, states = drafter.seen[-1]
    state = target.hidden_for(prefix[: q + 1])
    assert torch.equal(drafter._head_states(state, after), states)
    assert not torch.equal(drafter._head_states(state, (after + 1) % 10), states)
    assert torch.equal(drafter._head_states(state, None), drafter._head_states(state, int(target.output_logits(state[None]).argmax())))


def test_chained_heads_expand_each_node_from_the_state_its_parents_token_leads_to() -> None:
    """Chained heads: depth 0 is drawn from s_1 = g(h_q, e(x_{q+1})), and a node's children from g(its
    parent's state, e(its token)). Recomputed here node by node from the head's step and the level's
    own output head and embedding (a drafter stepping on another token, or on the wrong parent, fails)."""
    import attrs

    target = SyntheticLM(vocab_size=10, seed=1, sharpness=2.0)
    heads = synthetic_heads(10, chained=True)
    heads.info = attrs.evolve(heads.info, accuracy=[[0.5, 0.4], [0.5, 0.4], [0.5, 0.4]])
    drafter = MedusaDrafter(vocab=10, heads=heads, tree_size=9, top_k=2, min_prob=0.0)
    prompt = list(range(10)) * 3
    stack = SpeculationStack.build([Level(drafter=drafter), Level(model=target, gamma=drafter.step)])
    prefix = prompt + list(stack.generate(prompt, 12).tokens)
    draft = drafter.propose(prefix, drafter.step)
    q, h = drafter._channel.latest(prefix)
    assert q == len(prefix) - 2 and len(draft) == 9 and int(draft.parents.max()) >= 2  # three depths, branching
    step = lambda state, token: heads.step(state[None], target.input_embeddings(torch.tensor([token])))[0]  # noqa: E731
    states = {-1: step(h, prefix[-1])}  # node -> the state its children are drawn from
    for node in range(len(draft)):
        parent = int(draft.parents[node])
        logits = target.output_logits(states[parent][None])[0]  # [V]
        assert torch.allclose(draft.probs[node], torch.softmax(logits, -1), atol=1e-6)
        assert int(draft.tokens[node]) in logits.topk(2).indices.tolist()
        states[node] = step(states[parent], int(draft.tokens[node]))
    siblings = [n for n in range(len(draft)) if int(draft.parents[n]) == -1]
    assert len(siblings) == 2 and not torch.equal(states[siblings[0]], states[siblings[1]])


class CountingSteps(MedusaDrafter):
    """Counts the chained head's steps."""

    steps: int = 0

    def _step(self, states, tokens):
        self.steps += 1
        return super()._step(states, tokens)


def test_chained_heads_stop_growing_at_a_depth_where_no_node_is_kept() -> None:
    """A chained tree grows depth by depth only while a node of the last depth grown is kept: a deeper node's path
    probability is at most its parent's, so with ``min_prob`` the draft is the whole tree's confident subtree, node
    for node, and the head steps past the first depth with no kept node never run (a drafter that grows every
    depth, or stops at the first depth that lost a node, fails)."""
    import attrs

    target = SyntheticLM(vocab_size=10, seed=1, sharpness=2.0)
    heads = synthetic_heads(10, chained=True)
    heads.info = attrs.evolve(heads.info, accuracy=[[0.5, 0.4], [0.5, 0.4], [0.5, 0.4]])
    prompt = list(range(10)) * 3
    drafters = {least: CountingSteps(vocab=10, heads=heads, tree_size=9, top_k=2, min_prob=least) for least in (0.0, 0.2)}
    stacks = {least: SpeculationStack.build([Level(drafter=d), Level(model=target, gamma=d.step)]) for least, d in drafters.items()}
    prefix = prompt + list(stacks[0.0].generate(prompt, 12).tokens)
    assert list(stacks[0.2].generate(prompt, 12).tokens) == prefix[len(prompt):]
    stopped = 0
    for end in range(len(prompt) + 1, len(prefix) + 1):
        whole = drafters[0.0].propose(prefix[:end], 3)
        if len(whole) == 0:  # no state for this prefix
            continue
        node_probs = whole.probs.gather(1, whole.tokens[:, None])[:, 0].tolist()
        parents = whole.parents.tolist()
        kept = confident_nodes(node_probs, parents, 0.2)
        pruned, before = drafters[0.2], drafters[0.2].steps
        draft = pruned.propose(prefix[:end], 3)
        assert draft.tokens.tolist() == [int(whole.tokens[i]) for i in kept]
        assert draft.parents.tolist() == [kept.index(parents[i]) if parents[i] >= 0 else -1 for i in kept]
        depths = [0 if p < 0 else -1 for p in parents]
        for i, p in enumerate(parents):
            depths[i] = 0 if p < 0 else depths[p] + 1
        grown = min(max(depths) + 1, max((depths[i] for i in kept), default=-1) + 2)  # up to the first depth keeping nothing
        first_step = 1 if pruned._channel.latest(prefix[:end])[0] == end - 2 else 0
        assert pruned.steps - before == first_step + grown - 1
        stopped += grown < max(depths) + 1
    assert stopped >= 3


def test_chained_heads_need_token_input() -> None:
    with pytest.raises(SpecstackError, match="chained medusa heads read the token after each state; set token_input too"):
        HeadsInfo(hidden_size=8, heads=3, vocab_size=10, chained=True)


def _ranked(heads: MedusaHeads, seed: int = 0) -> MedusaHeads:
    heads.token_rank = torch.randperm(heads.info.vocab_size, generator=torch.Generator().manual_seed(seed))  # [V]
    return heads


@pytest.mark.parametrize("kind", ["state+token", "chained"])
def test_a_draft_vocabulary_drafts_only_its_tokens_and_keeps_greedy_output(kind: str) -> None:
    """draft_vocab = R (here the heads file's own default): every candidate is among the heads' first R
    ranked tokens and its row is zero elsewhere (a softmax over those R logits); the output is still the
    target's greedy decoding. draft_vocab=0 drafts from the whole vocabulary."""
    import attrs

    target = SyntheticLM(vocab_size=16, seed=1, sharpness=2.0)
    heads = _ranked(synthetic_heads(16, **HEADS[kind]))
    heads.info = attrs.evolve(heads.info, draft_vocab=6)
    assert MedusaDrafter(vocab=16, heads=heads, draft_vocab=0).draft_vocab == 0
    drafter = MedusaDrafter(vocab=16, heads=heads, tree_size=8)
    assert drafter.draft_vocab == 6
    prompt = list(range(8)) * 3
    stack = SpeculationStack.build([Level(drafter=drafter), Level(model=target, gamma=drafter.step)])
    assert list(stack.generate(prompt, 30).tokens) == greedy_decode(target, prompt, 30)
    allowed = heads.token_rank[:6]
    draft = drafter.propose(prompt + greedy_decode(target, prompt, 5), drafter.step)
    assert len(draft) > 0 and all(int(t) in allowed.tolist() for t in draft.tokens)
    outside = torch.ones(16, dtype=torch.bool)
    outside[allowed] = False
    assert torch.all(draft.probs[:, outside] == 0) and torch.allclose(draft.probs.sum(-1), torch.ones(len(draft)))


def test_a_levels_output_head_rows_are_its_logits_columns() -> None:
    """HFCausalLM.output_head(rows) (the draft vocabulary's logits) computes the LM head's columns ``rows``:
    exactly in bf16; in fp32 up to rounding, since a GEMM with 5 output columns may sum in another order than
    one with 256 (seen on an AVX2 host: 1-2 ulp). Only the drafter reads these logits, so lossless output
    does not depend on it."""
    from specstack.testing.llama import random_llama

    rows = torch.tensor([5, 0, 77, 3, 255])
    for dtype, tolerance in ((torch.float32, 1e-6), (torch.bfloat16, 0.0)):
        model = random_llama(dtype=dtype)
        states = torch.randn(3, model.hidden_size)
        part, whole = model.output_head(rows)(states), model.output_logits(states)[:, rows]  # [3, 5] x2
        assert torch.allclose(part, whole, rtol=tolerance, atol=tolerance), (dtype, (part - whole).abs().max())


def test_sampled_medusa_with_a_draft_vocabulary_keeps_the_target_distribution() -> None:
    sampling = SamplingConfig(temperature=0.8)
    target = SyntheticLM(vocab_size=4, seed=11, sharpness=1.5)
    drafter = MedusaDrafter(vocab=4, heads=_ranked(synthetic_heads(4, chained=True)), tree_size=6, draft_vocab=2)
    stack = SpeculationStack.build([Level(drafter=drafter), Level(model=target, gamma=drafter.step)], sampling=sampling, seed=3)
    assert stack_pvalue(stack, target, sampling, PROMPT) > ALPHA


def test_bad_draft_vocabularies_are_one_line_errors(tmp_path) -> None:
    with pytest.raises(SpecstackError, match="medusa draft_vocab 17 is not allowed; use 0 \\(the whole vocabulary\\) or an integer from 1 to 16"):
        MedusaDrafter(vocab=16, heads=_ranked(synthetic_heads(16)), draft_vocab=17)
    with pytest.raises(SpecstackError, match="medusa draft_vocab=4 needs heads that carry the target's token ranking"):
        MedusaDrafter(vocab=16, heads=synthetic_heads(16), draft_vocab=4)
    heads = _ranked(synthetic_heads(16, chained=True), seed=5)
    save_heads(tmp_path / "h.safetensors", heads)
    assert torch.equal(load_heads(tmp_path / "h.safetensors").token_rank, heads.token_rank)  # the ranking travels with the file


# -- greedy losslessness ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind", list(HEADS))
@pytest.mark.parametrize("tree_size", [1, 4, 12])
def test_medusa_greedy_equals_the_target_greedy(tree_size: int, kind: str) -> None:
    target = SyntheticLM(vocab_size=16, seed=1, sharpness=2.0)
    drafter = _medusa(16, tree_size=tree_size, kind=kind)
    stack = SpeculationStack.build([Level(drafter=drafter), Level(model=target, gamma=drafter.step)])
    prompt = list(range(8)) * 3
    assert list(stack.generate(prompt, 30).tokens) == greedy_decode(target, prompt, 30)


def test_the_recipes_are_greedy_lossless(registry) -> None:
    target = SyntheticLM(vocab_size=16, seed=2, sharpness=2.0)
    prompt = list(range(8)) * 5
    for name, options, level0 in [("medusa", {}, "medusa"), ("medusa-chain", {"heads": synthetic_heads(16, chained=True)}, "medusa"),
                                  ("triforce-medusa", SMALL, "medusa"), ("medusa-lookup", {}, "prompt-lookup+medusa"),
                                  ("triforce-medusa-lookup", SMALL, "prompt-lookup+medusa")]:
        stack = registry.stack(name, target=target, tree_size=10, **{"heads": synthetic_heads(16), **options})
        result = stack.generate(prompt, 30)
        assert list(result.tokens) == greedy_decode(target, prompt, 30), name
        assert result.levels[0].name == level0 and result.levels[1].drafted > result.levels[1].rounds  # trees, not single tokens
    for name in ("triforce-medusa", "triforce-medusa-lookup"):
        assert registry.stack(name, target=target, heads=synthetic_heads(16), **SMALL).top.drafter.lm.policy.name == "retrieval"


# -- sampled losslessness --------------------------------------------------------------------------


@pytest.mark.parametrize("kind", list(HEADS))
@pytest.mark.parametrize("sampling", [SamplingConfig(temperature=0.8), SamplingConfig(temperature=0.9, top_p=0.8)], ids=["t0.8", "top_p"])
def test_sampled_medusa_keeps_the_target_distribution(sampling: SamplingConfig, kind: str) -> None:
    """Candidates taken by rank (``draft_temperature=0``; drawn ones: below)."""
    target = SyntheticLM(vocab_size=4, seed=11, sharpness=1.5)
    drafter = _medusa(4, tree_size=6, kind=kind, draft_temperature=0)
    stack = SpeculationStack.build([Level(drafter=drafter), Level(model=target, gamma=drafter.step)], sampling=sampling, seed=3)
    assert stack.top.verifier.name == "token-tree"
    assert stack_pvalue(stack, target, sampling, PROMPT) > ALPHA


def test_sampled_medusa_merged_with_prompt_lookup_keeps_the_target_distribution(registry) -> None:
    """``medusa-lookup``: the heads' tree and prompt lookup's chain merged into one deterministic tree."""
    sampling = SamplingConfig(temperature=0.8)
    target = SyntheticLM(vocab_size=4, seed=11, sharpness=1.5)
    stack = registry.stack("medusa-lookup", target=target, heads=synthetic_heads(4, token_input=True), tree_size=6, sampling=sampling, seed=3,
                           first_only=False, min_ngram=1)
    assert stack.top.verifier.name == "token-tree" and stack.top.drafter.name == "merged"
    assert stack_pvalue(stack, target, sampling, [1, 2, 3, 1, 2]) > ALPHA


def test_sampled_triforce_over_the_merged_draft_keeps_the_target_distribution(registry) -> None:
    """``triforce-medusa-lookup``: the merged tree verified by the target over its retrieval view, whose chains the
    target verifies."""
    sampling = SamplingConfig(temperature=0.8)
    target = SyntheticLM(vocab_size=4, seed=11, sharpness=1.5)
    stack = registry.stack("triforce-medusa-lookup", target=target, heads=synthetic_heads(4, token_input=True), tree_size=6, sampling=sampling,
                           seed=3, first_only=False, min_ngram=1, gamma2=3, **SMALL)
    assert stack.top.drafter.drafter.name == "merged" and stack.top.drafter.lm.policy.name == "retrieval"
    assert stack_pvalue(stack, target, sampling, [1, 2, 3, 1, 2, 0] * 4) > ALPHA  # longer than the retrieval budget


def test_sampled_medusa_under_a_middle_level_keeps_the_target_distribution() -> None:
    sampling = SamplingConfig(temperature=0.8)
    target = SyntheticLM(vocab_size=4, seed=21, sharpness=1.5)
    middle = SyntheticLM(vocab_size=4, seed=22, base=target, noise=0.5)
    drafter = _medusa(4, tree_size=6)
    levels = [Level(drafter=drafter), Level(model=middle, gamma=drafter.step), Level(model=target, gamma=3)]
    stack = SpeculationStack.build(levels, sampling=sampling, seed=5)
    assert stack_pvalue(stack, target, sampling, PROMPT) > ALPHA


class ClaimsSampled(MedusaDrafter):
    """Deliberately wrong: drafts the heads' top-1 chain (deterministic) but declares it a chain drawn
    from the heads' softmax rows, so that speculative sampling trusts q."""

    draft_kind = DraftKind.CHAIN

    def propose(self, prefix, n: int) -> Draft:
        tree, chain = super().propose(prefix, n), []
        while tree.is_tree and (children := tree.children(chain[-1] if chain else -1)):
            chain.append(children[0])  # the top-1 path
        return Draft(tokens=tree.tokens[chain], probs=tree.probs[chain]) if chain else Draft.empty(self.vocab)


def test_synthetic_hidden_states_are_the_same_in_every_process() -> None:
    """The lie below is caught with a margin that depends on the hidden states; they once followed
    Python's per-process string hashing, and the check failed in about one process in thirty."""
    import os
    import subprocess
    import sys

    code = "from specstack.synthetic import SyntheticLM; print(SyntheticLM(vocab_size=4, seed=11).hidden_for([1, 2, 3]).tolist())"
    printed = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                              env={**os.environ, "PYTHONHASHSEED": seed}).stdout for seed in ("1", "34")}
    assert len(printed) == 1 and printed.pop().startswith("[")


def test_a_drafter_that_lies_about_its_draws_is_caught() -> None:
    sampling = SamplingConfig(temperature=0.8)
    target = SyntheticLM(vocab_size=4, seed=11, sharpness=1.5)
    info = HeadsInfo(hidden_size=8, heads=3, vocab_size=4, accuracy=[[0.9, 0.01]] * 3)  # the tree is the top-1 chain
    liar = ClaimsSampled(vocab=4, heads=MedusaHeads.random(info), tree_size=4, draft_temperature=0)  # top ranks, said to be drawn
    stack = SpeculationStack.build([Level(drafter=liar), Level(model=target, gamma=liar.step)], sampling=sampling, seed=3)
    assert stack.top.verifier.name == "speculative"
    assert stack_pvalue(stack, target, sampling, PROMPT) < ALPHA


# -- drawn candidates (draft_temperature > 0) --------------------------------------------------------


def _drawing(vocab: int, *, kind: str, temperature: float = 1.0, tree_size: int = 6) -> MedusaDrafter:
    return MedusaDrafter(vocab=vocab, heads=synthetic_heads(vocab, **HEADS[kind]), tree_size=tree_size, draft_temperature=temperature)


@pytest.mark.parametrize("kind", list(HEADS))
@pytest.mark.parametrize("sampling", [SamplingConfig(temperature=0.8), SamplingConfig(temperature=0.9, top_p=0.8)], ids=["t0.8", "top_p"])
def test_medusa_drawing_its_candidates_keeps_the_target_distribution(sampling: SamplingConfig, kind: str) -> None:
    target = SyntheticLM(vocab_size=4, seed=11, sharpness=1.5)
    drafter = _drawing(4, kind=kind)
    stack = SpeculationStack.build([Level(drafter=drafter), Level(model=target, gamma=drafter.step)], sampling=sampling, seed=3)
    assert stack.top.verifier.name == "sequoia" and drafter.draft_kind is DraftKind.TREE_WITHOUT_REPLACEMENT
    assert stack_pvalue(stack, target, sampling, PROMPT) > ALPHA


def test_drawn_candidates_are_each_parents_first_draws_and_follow_the_seed() -> None:
    """Siblings are distinct (drawn without replacement), each node's row is its parent's distribution, the tree is the
    one the ranks' probabilities choose, and the draws change with the stack's seed and repeat with it."""
    target = SyntheticLM(vocab_size=8, seed=11, sharpness=1.5)
    drafter = _drawing(8, kind="chained", tree_size=8)
    stack = SpeculationStack.build([Level(drafter=drafter), Level(model=target, gamma=drafter.step)], sampling=SamplingConfig(temperature=1.0), seed=3)
    texts = {seed: stack.generate([1, 2, 3], 12, seed=seed).tokens for seed in (0, 1, 0)}
    assert len(texts) == 2  # seeds 0 and 1 differ; seed 0 twice gave one text
    draft = drafter.propose([1, 2, 3, 4], 3)
    assert draft.kind is DraftKind.TREE_WITHOUT_REPLACEMENT and len(draft) > 1
    parents = draft.parent_index().tolist()
    for parent in set(parents):
        children = [i for i, p in enumerate(parents) if p == parent]
        assert len({int(draft.tokens[i]) for i in children}) == len(children)  # without replacement
        assert all(torch.equal(draft.probs[i], draft.probs[children[0]]) for i in children)  # siblings share their q
        assert all(float(draft.probs[i, draft.tokens[i]]) > 0 for i in children)


class DrawsAtAnotherTemperature(MedusaDrafter):
    """Deliberately wrong: draws its candidates from q^4 renormalised (the heads at τ / 4) but hands the verifier q."""

    def _first_draws(self, dist, parents, slots):
        sharper = dist.pow(4)  # [f, R]
        return super()._first_draws(sharper / sharper.sum(-1, keepdim=True), parents, slots)


def test_a_drafter_that_draws_otherwise_than_it_says_is_caught() -> None:
    sampling = SamplingConfig(temperature=1.0)
    target = SyntheticLM(vocab_size=4, seed=11, sharpness=1.5)
    liar = DrawsAtAnotherTemperature(vocab=4, heads=synthetic_heads(4, token_input=True), tree_size=2, draft_temperature=1.0)
    stack = SpeculationStack.build([Level(drafter=liar), Level(model=target, gamma=liar.step)], sampling=sampling, seed=3)
    assert stack_pvalue(stack, target, sampling, PROMPT) < ALPHA


def test_drawn_candidates_merged_with_prompt_lookup_keep_the_target_distribution(registry) -> None:
    """``medusa-lookup -o draft_temperature=…``: lookup's chain where it matches, else the drawn tree, both verified by
    Sequoia's rule; a union of the two (``first_only=false``) is refused in one line."""
    sampling = SamplingConfig(temperature=0.8)
    target = SyntheticLM(vocab_size=4, seed=11, sharpness=1.5)
    stack = registry.stack("medusa-lookup", target=target, heads=synthetic_heads(4, token_input=True), tree_size=6, sampling=sampling, seed=3,
                           min_ngram=1, draft_temperature=1.0)
    assert stack.top.verifier.name == "sequoia" and stack.top.drafter.draft_kind is DraftKind.TREE_WITHOUT_REPLACEMENT
    assert stack_pvalue(stack, target, sampling, [1, 2, 3, 1, 2]) > ALPHA
    with pytest.raises(SpecstackError, match="only with first_only=true and beside chains"):
        registry.stack("medusa-lookup", target=target, heads=synthetic_heads(4, token_input=True), sampling=sampling, first_only=False,
                       draft_temperature=1.0)


def test_drawn_candidates_under_the_retrieval_level_keep_the_target_distribution(registry) -> None:
    sampling = SamplingConfig(temperature=0.8)
    target = SyntheticLM(vocab_size=4, seed=11, sharpness=1.5)
    stack = registry.stack("triforce-medusa", target=target, heads=synthetic_heads(4, token_input=True), tree_size=6, sampling=sampling, seed=3,
                           gamma2=3, draft_temperature=0.7, **SMALL)
    assert stack_pvalue(stack, target, sampling, [1, 2, 3, 1, 2, 0] * 4) > ALPHA


@pytest.mark.parametrize("kind", list(HEADS))
def test_drawn_candidates_keep_greedy_output(kind: str) -> None:
    target = SyntheticLM(vocab_size=6, seed=5, sharpness=2.0)
    drafter = _drawing(6, kind=kind)
    stack = SpeculationStack.build([Level(drafter=drafter), Level(model=target, gamma=drafter.step)])
    assert list(stack.generate([1, 2], 30).tokens) == greedy_decode(target, [1, 2], 30)


@pytest.mark.parametrize("value", [-0.5, float("inf"), True, "warm"])
def test_a_bad_draft_temperature_is_one_line(value) -> None:
    with pytest.raises(SpecstackError, match=f"medusa draft_temperature {value!r} is not allowed; use 'follow'"):
        MedusaDrafter(vocab=4, heads=synthetic_heads(4), draft_temperature=value)


# -- draft_temperature="follow": drawn at the stack's temperature where it samples ---------------------------------


@pytest.mark.parametrize(("sampling", "kind"), [
    (SamplingConfig(temperature=0.8), DraftKind.TREE_WITHOUT_REPLACEMENT),
    (SamplingConfig(), DraftKind.TREE_DETERMINISTIC),
    (SamplingConfig(temperature=0.8, coupled=True), DraftKind.TREE_DETERMINISTIC),
], ids=["sampled", "greedy", "coupled"])
def test_follow_draws_where_the_stack_samples_and_ranks_elsewhere(sampling: SamplingConfig, kind: DraftKind) -> None:
    target = SyntheticLM(vocab_size=4, seed=11, sharpness=1.5)
    drafter = MedusaDrafter(vocab=4, heads=synthetic_heads(4, chained=True), tree_size=6, draft_temperature="follow")
    assert drafter.draft_kind is DraftKind.TREE_DETERMINISTIC  # until a stack says
    stack = SpeculationStack.build([Level(drafter=drafter), Level(model=target, gamma=drafter.step)], sampling=sampling, seed=3)
    assert drafter.draft_kind is kind
    assert stack.top.verifier.name == ("sequoia" if kind is DraftKind.TREE_WITHOUT_REPLACEMENT else "greedy")
    if kind is DraftKind.TREE_WITHOUT_REPLACEMENT:
        assert stack_pvalue(stack, target, sampling, PROMPT) > ALPHA


def test_follow_draws_as_an_explicit_draft_temperature_of_the_stacks() -> None:
    """At T = 0.7 ``follow`` writes the text, and drafts the tokens, that draft_temperature=0.7 does with the same
    seed; the default, top ranks, drafts otherwise."""
    sampling = SamplingConfig(temperature=0.7)
    target = SyntheticLM(vocab_size=8, seed=11, sharpness=1.5)

    def run(**options):
        drafter = MedusaDrafter(vocab=8, heads=synthetic_heads(8, chained=True), tree_size=8, **options)
        stack = SpeculationStack.build([Level(drafter=drafter), Level(model=target, gamma=drafter.step)], sampling=sampling, seed=3)
        result = stack.generate([1, 2, 3], 24, seed=5)
        return list(result.tokens), [(s.drafted, s.accepted) for s in result.levels]

    assert run(draft_temperature="follow") == run(draft_temperature=0.7)
    assert run(draft_temperature="follow") != run()


def test_a_union_takes_following_heads_by_rank(registry) -> None:
    """``medusa-lookup -o first_only=false -o draft_temperature=follow`` at T > 0: a union cannot carry drawn siblings,
    so the heads take their top ranks there, and the stack keeps the target's distribution (a number is refused above)."""
    sampling = SamplingConfig(temperature=0.8)
    target = SyntheticLM(vocab_size=4, seed=11, sharpness=1.5)
    stack = registry.stack("medusa-lookup", target=target, heads=synthetic_heads(4, token_input=True), tree_size=6, sampling=sampling, seed=3,
                           min_ngram=1, first_only=False, draft_temperature="follow")
    assert stack.top.drafter.draft_kind is DraftKind.TREE_DETERMINISTIC and stack.top.verifier.name == "token-tree"
    assert stack_pvalue(stack, target, sampling, [1, 2, 3, 1, 2]) > ALPHA
    merged = registry.stack("medusa-lookup", target=target, heads=synthetic_heads(4, token_input=True), sampling=sampling, min_ngram=1,
                            draft_temperature="follow").top.drafter
    assert merged.draft_kind is DraftKind.TREE_WITHOUT_REPLACEMENT  # first_only (the default) carries them
