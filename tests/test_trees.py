"""Token trees in the core: drafts that stay trees, tree attention in the KV store for every kind of
cache view, and the checks a stack makes when it is built and after every verdict."""

from __future__ import annotations

import pytest
import torch

from specstack import CachedModel, Drafter, FullCache, Level, LevelStats, SamplingConfig, SpecstackError, SpeculationStack, StreamingLLM, Verifier
from specstack.channels import FullCacheChannel
from specstack.retrieval import Retrieval
from specstack.synthetic import SyntheticLM, greedy_decode
from specstack.types import Capability, Draft, DraftKind, Verdict
from specstack.verify import GreedyVerifier, SpeculativeSamplingVerifier

#        0
#      /   \
#     1     2        parents: [-1, -1, 0, 0, 1, 2]   depths: [0, 0, 1, 1, 1, 2]
#    / \    |
#   2   3   4
#   |
#   5
PARENTS = torch.tensor([-1, -1, 0, 0, 1, 2])
TOKENS = torch.tensor([3, 4, 5, 6, 7, 8])


def tree(kind: DraftKind = DraftKind.TREE_DETERMINISTIC, tokens: torch.Tensor = TOKENS, vocab: int = 9) -> Draft:
    return Draft(tokens=tokens, probs=torch.full((len(tokens), vocab), 1 / vocab), parents=PARENTS, kind=kind)


# -- drafts -------------------------------------------------------------------------------------


def test_head_keeps_a_tree_a_tree() -> None:
    """Draft.head used to rebuild the draft without parents, so a tree was verified as a chain."""
    head = tree(DraftKind.TREE_WITHOUT_REPLACEMENT).head(2)
    assert head.is_tree and head.kind is DraftKind.TREE_WITHOUT_REPLACEMENT
    assert head.parents.tolist() == [-1, -1, 0, 0, 1] and head.tokens.tolist() == [3, 4, 5, 6, 7]
    assert tree().head(1).parents.tolist() == [-1, -1]
    assert len(tree().head(3)) == 6


def test_stop_at_cuts_the_subtrees_below_a_stop_token() -> None:
    cut = tree().stop_at(frozenset({5}))  # node 2 holds token 5: its child (node 5) goes
    assert cut.tokens.tolist() == [3, 4, 5, 6, 7] and cut.parents.tolist() == [-1, -1, 0, 0, 1]
    chain = Draft(tokens=torch.tensor([1, 5, 2]), probs=torch.full((3, 9), 1 / 9))
    assert chain.stop_at(frozenset({5})).tokens.tolist() == [1, 5]


def test_parents_must_be_topologically_ordered() -> None:
    with pytest.raises(ValueError, match="topologically ordered"):
        Draft(tokens=torch.tensor([1, 2]), probs=torch.full((2, 4), 0.25), parents=torch.tensor([1, -1]), kind=DraftKind.TREE_DETERMINISTIC)
    with pytest.raises(ValueError, match="needs parents"):
        Draft(tokens=torch.tensor([1]), probs=torch.full((1, 4), 0.25), kind=DraftKind.TREE_DETERMINISTIC)


# -- tree attention over every kind of view -----------------------------------------------------


def _levels(model: SyntheticLM) -> dict[str, CachedModel]:
    full = CachedModel(model, FullCache(), LevelStats(name="full"))
    return {
        "full": full,
        "streaming": CachedModel(model, StreamingLLM(sinks=2, window=12), LevelStats(name="streaming")),
        "retrieval": CachedModel(model, Retrieval(budget=8, chunk_size=2, stride=4, reserve=12), LevelStats(name="retrieval"),
                                 channel=full.open_channel()),
    }


@pytest.mark.parametrize("view", ["full", "streaming", "retrieval", "h2o"])
def test_one_forward_scores_every_path_of_the_tree_and_keeps_the_accepted_one(view) -> None:
    """Each node's logits are those of its own path over the level's view; after accept_path the
    view holds exactly the accepted path, and decoding continues as if it had been fed as a chain."""
    model = SyntheticLM(vocab_size=9, seed=1)
    levels = _levels(model)
    if view == "h2o":
        from specstack_h2o import H2O

        levels["h2o"] = CachedModel(model, H2O(budget=8, recent=4, reserve=4), LevelStats(name="h2o"))
    lm, full = levels[view], levels["full"]
    prefix = [1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3, 4, 5, 6, 7, 8, 2]
    full.logits(prefix, 1)
    lm.logits(prefix[:-1], 1)
    draft = tree()
    rows = lm.tree_logits(prefix, draft)  # [k+1, V]
    held = lm.cache.values[0, 0, : len(lm.cache) - len(draft), 0].long().tolist()  # the view before the tree
    assert torch.equal(rows[0], model.logits_for(held))
    for node in range(len(draft)):
        path = [int(draft.tokens[i]) for i in draft.path(node)]
        assert torch.equal(rows[node + 1], model.logits_for([*held, *path])), f"node {node} does not see its own path"
    lm.accept_path([1, 4])  # tokens 4, 7
    after = lm.cache.values[0, 0, : len(lm.cache), 0].long().tolist()
    assert after == [*held, 4, 7] and lm.cache.positions[-2:].tolist() == [len(prefix), len(prefix) + 1]
    row = lm.logits([*prefix, 4, 7, 0], 1)[0]  # continue: one more token fed as a chain
    assert torch.equal(row, model.logits_for([*lm.cache.values[0, 0, : len(lm.cache), 0].long().tolist()]))


def test_a_tree_that_does_not_fit_the_view_is_named() -> None:
    lm = CachedModel(SyntheticLM(vocab_size=9, seed=1), StreamingLLM(sinks=1, window=4), LevelStats(name="small"))
    lm.logits([1, 2, 3], 1)
    with pytest.raises(SpecstackError, match="a tree of 6 tokens does not fit level 'small', whose cache holds 5 slots"):
        lm.tree_logits([1, 2, 3, 4], tree())


def test_the_full_cache_channel_is_the_only_way_a_gathering_level_reads_the_level_above() -> None:
    model = SyntheticLM(vocab_size=9, seed=1)
    full = CachedModel(model, FullCache(), LevelStats(name="full"))
    channel = full.open_channel()
    assert isinstance(channel, FullCacheChannel)
    full.logits([1, 2, 3, 4, 5], 1)
    assert channel.horizon([1, 2, 3, 4]) == 4 and channel.keys(4).shape == (1, 1, 4, model.head_dim)
    assert channel.queries.queries.shape == (1, 1, model.head_dim)  # the last committed token's query
    with pytest.raises(SpecstackError, match="needs a full-cache level"):
        CachedModel(model, Retrieval(budget=8, chunk_size=2), LevelStats(name="r"))


# -- checks when a stack is built, and after each verdict -----------------------------------------


class TreeOnly(Drafter):
    """A model-free drafter that always proposes the tree above (deterministic)."""

    name = "fixed-tree"
    draft_kind = DraftKind.TREE_DETERMINISTIC

    def __init__(self, vocab: int = 9) -> None:
        self.vocab = vocab
        self.stats = LevelStats(name="fixed-tree")

    @property
    def vocab_size(self) -> int:
        return self.vocab

    def propose(self, prefix, n) -> Draft:
        return tree(vocab=self.vocab).head(n)

    def level_stats(self) -> list[LevelStats]:
        return [self.stats]


class NeedsHiddenStates(TreeOnly):
    name = "needs-hidden-states"
    requires = frozenset({Capability.HIDDEN_STATES})


def test_a_verifier_that_cannot_verify_the_draft_kind_is_refused_when_the_stack_is_built() -> None:
    target = SyntheticLM(vocab_size=9, seed=1)
    with pytest.raises(SpecstackError, match="verifier 'speculative' at level 1 cannot verify tree-deterministic drafts from 'fixed-tree'"):
        SpeculationStack.build([Level(drafter=TreeOnly()), Level(model=target, gamma=3, verifier=SpeculativeSamplingVerifier())],
                               sampling=SamplingConfig(temperature=1.0))


def test_drafter_requirements_are_checked_against_the_verifying_model() -> None:
    target = SyntheticLM(vocab_size=9, seed=1, capabilities=frozenset(Capability) - {Capability.HIDDEN_STATES})
    with pytest.raises(SpecstackError, match="drafter 'needs-hidden-states' at level 1 needs hidden_states"):
        SpeculationStack.build([Level(drafter=NeedsHiddenStates()), Level(model=target, gamma=3)])
    flat = SyntheticLM(vocab_size=9, seed=1, capabilities=frozenset({Capability.KEYS}))
    with pytest.raises(SpecstackError, match="needs tree_attention"):
        SpeculationStack.build([Level(drafter=TreeOnly()), Level(model=flat, gamma=3)])


class NeedsQueries(GreedyVerifier):
    name = "needs-queries"
    requires = frozenset({Capability.QUERIES})


def test_verifier_requirements_are_checked_against_the_model() -> None:
    flat = SyntheticLM(vocab_size=9, seed=1, capabilities=frozenset({Capability.KEYS}))
    with pytest.raises(SpecstackError, match="verifier 'needs-queries' at level 1 needs queries"):
        SpeculationStack.build([Level(model=flat), Level(model=flat, gamma=3, verifier=NeedsQueries())])


class OffPath(GreedyVerifier):
    """A plugin verifier returning an accepted list that is not a root path of the tree."""

    name = "off-path"

    def verify(self, draft: Draft, p: torch.Tensor, generator: torch.Generator) -> Verdict:
        return Verdict(accepted=(0, 4), next_token=1, bonus=False)  # node 4's parent is 1, not 0


def test_a_plugin_verdict_that_is_not_a_root_path_is_refused() -> None:
    target = SyntheticLM(vocab_size=9, seed=1)
    stack = SpeculationStack.build([Level(drafter=TreeOnly()), Level(model=target, gamma=3, verifier=OffPath())])
    with pytest.raises(SpecstackError, match="off-path"):
        stack.generate([1, 2, 3], 5)


def test_greedy_tree_stacks_equal_argmax_decoding_over_every_view() -> None:
    target = SyntheticLM(vocab_size=9, seed=4, sharpness=2.0)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8] * 3
    expected = greedy_decode(target, prompt, 30)
    for middle in (FullCache(), StreamingLLM(sinks=2, window=14), Retrieval(budget=8, chunk_size=2, stride=4, reserve=12)):
        levels = [Level(drafter=TreeOnly()), Level(model=target, policy=middle, gamma=3), Level(model=target, gamma=4)]
        assert list(SpeculationStack.build(levels).generate(prompt, 30).tokens) == expected, middle.name
    assert list(SpeculationStack.build([Level(drafter=TreeOnly()), Level(model=target, gamma=3)]).generate(prompt, 30).tokens) == expected


class LookupWithStop(TreeOnly):
    """Proposes the chain [stop, 1, 2, 3]: a stop token first, then tokens the level must not verify."""

    name = "stop-first"
    draft_kind = DraftKind.CHAIN

    def propose(self, prefix, n) -> Draft:
        tokens = torch.tensor([0, 1, 2, 3])[:n]
        return Draft(tokens=tokens, probs=torch.zeros(len(tokens), self.vocab).scatter_(1, tokens[:, None], 1.0))


def test_no_round_runs_past_a_stop_token() -> None:
    vocab = 9
    target = SyntheticLM(vocab_size=vocab, seed=2, support=(0,))  # always emits the stop token 0
    stack = SpeculationStack.build([Level(drafter=LookupWithStop()), Level(model=target, gamma=4)], stop_tokens=(0,))
    result = stack.generate([5, 6], 10)
    assert result.tokens == (0,) and result.stopped_by == "eos"
    top = result.levels[-1]
    assert top.drafted == 1 and top.forward_tokens == 2  # the last prompt token and the stop token, nothing after it


class EveryTokenThenOne(TreeOnly):
    """A deterministic tree: every token as a child of the root, each with one child of its own."""

    name = "every-token"

    def propose(self, prefix, n) -> Draft:
        v = self.vocab
        tokens = torch.cat([torch.arange(v), (torch.arange(v) + 1) % v])  # [2V]
        parents = torch.cat([torch.full((v,), -1), torch.arange(v)])  # [2V]
        return Draft(tokens=tokens, probs=torch.full((2 * v, v), 1 / v), parents=parents, kind=DraftKind.TREE_DETERMINISTIC).head(n)


def test_a_middle_level_that_is_the_target_hands_up_the_rows_of_the_accepted_path() -> None:
    """Tree at L0, the target at L1 and L2, T > 0: L1 must hand up p's rows along the accepted path
    (row 0, then row i + 1 after each accepted node i), so L2 accepts every token it is offered.
    Rows taken as if the path were a chain (p[:m+1]) are misaligned on a tree and fail this."""
    target = SyntheticLM(vocab_size=6, seed=7, sharpness=2.0)
    levels = [Level(drafter=EveryTokenThenOne(vocab=6)), Level(model=target, gamma=2), Level(model=target, gamma=4)]
    result = SpeculationStack.build(levels, sampling=SamplingConfig(temperature=1.0)).generate([1, 2, 3], 300)
    middle, top = result.levels[1], result.levels[2]
    assert middle.accepted > 0
    assert top.drafted > 0 and top.acceptance_rate == 1.0


# -- merged drafts --------------------------------------------------------------------------------


class FixedChain(TreeOnly):
    """A model-free drafter that always proposes the chain ``tokens`` (one-hot rows)."""

    name = "fixed-chain"
    draft_kind = DraftKind.CHAIN

    def __init__(self, tokens: list[int], vocab: int = 9) -> None:
        super().__init__(vocab)
        self.tokens = tokens

    def propose(self, prefix, n) -> Draft:
        ids = torch.tensor(self.tokens[:n], dtype=torch.long)
        return Draft(tokens=ids, probs=torch.nn.functional.one_hot(ids, self.vocab).float())


def test_merged_drafts_are_the_union_of_the_parts_as_a_trie() -> None:
    """A chain 3, 6, 1 shares its first two nodes with the tree above (3, then its child 6) and adds
    one child below 6; a chain 4, 8 shares none (8 is a grandchild of 4 in the tree, not a child)."""
    from specstack import MergedDrafter

    merged = MergedDrafter(parts=(TreeOnly(), FixedChain([3, 6, 1]), FixedChain([4, 8])))
    draft = merged.propose([0], 3)
    assert draft.kind is DraftKind.TREE_DETERMINISTIC
    assert draft.tokens.tolist() == [3, 4, 5, 6, 7, 8, 1, 8]
    assert draft.parents.tolist() == [-1, -1, 0, 0, 1, 2, 3, 1]
    assert merged.level_stats()[0].name == "fixed-tree+fixed-chain+fixed-chain" and merged.level_stats()[0].drafted == 8
    assert MergedDrafter(parts=(FixedChain([3, 6, 1]), TreeOnly())).propose([0], 1).tokens.tolist() == [3, 4]  # depth 1 only


def test_with_first_only_the_first_part_that_drafts_is_the_draft() -> None:
    from specstack import MergedDrafter

    tree_part = TreeOnly()
    tree_part.propose = lambda prefix, n: pytest.fail("a later part was asked although an earlier one drafted")
    assert MergedDrafter(parts=(FixedChain([3, 6, 1]), tree_part), first_only=True).propose([0], 3).parents.tolist() == [-1, 0, 1]
    fallback = MergedDrafter(parts=(FixedChain([]), TreeOnly()), first_only=True).propose([0], 3)
    assert fallback.tokens.tolist() == TOKENS.tolist() and fallback.parents.tolist() == PARENTS.tolist()
    with pytest.raises(SpecstackError, match="first_only 'yes' is not allowed; use true or false"):
        MergedDrafter(parts=(TreeOnly(),), first_only="yes")


class PricedChain(FixedChain):
    """A fixed chain that takes prices and records the verdicts it is told."""

    def __init__(self, tokens: list[int]) -> None:
        super().__init__(tokens)
        self.prices, self.verdicts = [], []

    def price(self, verify_seconds) -> bool:
        self.prices.append(list(verify_seconds))
        return True

    def observe(self, drafted: int, accepted: int) -> None:
        self.verdicts.append((drafted, accepted))


def test_a_merged_drafter_prices_every_part_and_tells_a_verdict_to_the_part_that_drafted_alone() -> None:
    """Every part is told the prices (the merged drafter then chooses its drafts' size); a verdict reaches a part only
    when the draft was its alone: with first_only, the first part that drafted; without, only where no other part
    drafted anything. Fails where a verdict on a shared draft is told to a part, or where a sole part is not told."""
    from specstack import MergedDrafter

    empty, first, second = PricedChain([]), PricedChain([3, 6]), PricedChain([4])
    merged = MergedDrafter(parts=(empty, first, second), first_only=True)
    assert merged.price([1.0, 1.2, 1.5]) and empty.prices == first.prices == second.prices == [[1.0, 1.2, 1.5]]
    merged.observe(len(merged.propose([0], 2)), 1)
    assert first.verdicts == [(2, 1)] and empty.verdicts == second.verdicts == []
    union = MergedDrafter(parts=(first, second))
    union.observe(len(union.propose([0], 2)), 1)  # both drafted: the verdict is on neither's draft alone
    assert first.verdicts == [(2, 1)] and second.verdicts == []
    alone = MergedDrafter(parts=(empty, second))
    alone.observe(len(alone.propose([0], 2)), 0)
    assert second.verdicts == [(1, 0)] and empty.verdicts == []
    assert not MergedDrafter(parts=(TreeOnly(), FixedChain([3]))).price([1.0, 1.2])  # no part takes prices


def test_merged_drafts_take_model_free_parts_and_ask_what_their_parts_ask() -> None:
    from specstack import MergedDrafter, ModelDrafter

    draft_model = CachedModel(model=SyntheticLM(vocab_size=9, seed=2), policy=FullCache(), stats=LevelStats(name="draft"))
    with pytest.raises(SpecstackError, match="merged drafts take one or more model-free drafters; got \\['TreeOnly', 'ModelDrafter'\\]"):
        MergedDrafter(parts=(TreeOnly(), ModelDrafter(lm=draft_model, sampling=SamplingConfig(), generator=torch.Generator())))
    assert MergedDrafter(parts=(TreeOnly(), NeedsHiddenStates())).requires == {Capability.HIDDEN_STATES}
    target = SyntheticLM(vocab_size=9, seed=1, sharpness=2.0)
    prompt = [1, 2, 3, 4] * 6
    stack = SpeculationStack.build([Level(drafter=MergedDrafter(parts=(FixedChain([3, 6, 1]), TreeOnly()))), Level(model=target, gamma=3)])
    assert list(stack.generate(prompt, 20).tokens) == greedy_decode(target, prompt, 20)
