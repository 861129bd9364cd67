"""The Medusa drafter: candidates from heads on the hidden state of the level it drafts for.

Cai et al., 2024, "Medusa: Simple LLM Inference Acceleration Framework with Multiple Decoding
Heads". The level above scores a round and commits tokens; its last hidden state h_q at position q
reaches this drafter through a :class:`~specstack.channels.HiddenStateChannel` (the level opens it;
this drafter reads nothing else of it). Through that level's own LM head, h_q predicts x_{q+1} and
head k's state predicts x_{q+k+1}. Usually the last token of the prefix is the one the level has just
emitted and not yet fed, so q = len(prefix) - 2 and head 1 drafts the next token; right after a
prefill q = len(prefix) - 1 and the LM head itself drafts it.

Chained heads (one head applied step after step, :mod:`specstack_medusa.heads`) draft the same tree
of rank paths, but a node's candidates are ranks of the state its parent's token leads to, so the
tree is expanded depth by depth (one pass of the output head per depth).

The draft is a token tree of rank paths (:mod:`specstack_medusa.tree`): deterministic candidates
(``TREE_DETERMINISTIC``), verified losslessly by the greedy verifier at temperature 0 and by the
token-tree verifier above it. (Medusa's "typical acceptance" is not offered: it changes the output
distribution.) With a draw temperature (``draft_temperature`` > 0, or ``"follow"``: the stack's T where it
samples) the same tree's candidates are drawn from the heads' distributions instead, each parent's children
its first draws without replacement (``TREE_WITHOUT_REPLACEMENT``), verified by Sequoia's rule against those
distributions. When the
level holds no state for the prefix (a cache adopted from another stack; the level above rejected
what the level emitted), the draft is empty and the level samples one token on its own, which gives
the state for the next round.
"""

from __future__ import annotations

from typing import ClassVar, Sequence

import attrs
import torch

from specstack import Draft, LevelStats, SpecstackError
from specstack.channels import HiddenStateChannel
from specstack.drafters import ACCEPTANCE_WEIGHT, Drafter
from specstack.sampling import SamplingConfig, draw_without_replacement
from specstack.speedup import paying_nodes, subtree_parents
from specstack.types import Capability, DraftKind

from .heads import HeadsInfo, MedusaHeads, load_heads, shipped_heads, stream_on_cpu, synthetic_heads
from .tree import DepthCalibration, RankTree, choose_paths, confident_nodes, path_probabilities

UNTRAINED_ACCURACY = (0.5, 0.1, 0.05)  # rank accuracies assumed for heads that carry no measurement
RETRY = 0.02  # how far each round a depth is priced out moves its calibration toward 1, so that it is tried again
MIN_PROB = 0.1  # the default min_prob: measured best or within 0.03x of it among 0-0.3 in fp32 (docs/medusa.md)
FOLLOW = "follow"  # draft_temperature: draw at the stack's temperature where it samples, else take top ranks


def _size(instance, attribute, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise SpecstackError(f"medusa {attribute.name} {value!r} is not allowed; use an integer >= 1")


def _probability(instance, attribute, value) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value < 1:
        raise SpecstackError(f"medusa {attribute.name} {value!r} is not allowed; use a number from 0 (keep every node) up to but not including 1")


def _temperature(instance, attribute, value) -> None:
    if value != FOLLOW and (not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value < float("inf")):
        raise SpecstackError(f"medusa {attribute.name} {value!r} is not allowed; use {FOLLOW!r} (the stack's temperature where it samples), "
                             f"0 (the heads' top ranks, deterministic) or a positive temperature")


def _draft_vocab(instance, attribute, value) -> None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= instance.vocab):
        raise SpecstackError(f"medusa draft_vocab {value!r} is not allowed; use 0 (the whole vocabulary) or an integer from 1 to {instance.vocab}")


@attrs.define(eq=False, kw_only=True)
class MedusaDrafter(Drafter):
    """Level 0 of the ``medusa`` stacks: ``tree_size`` candidates from ``heads`` (a file, the name of heads
    shipped for the embedded default, ``parallel`` (the default) or ``chained``, or loaded
    :class:`MedusaHeads`), at most ``top_k`` ranks per head. With ``draft_vocab`` = R > 0 the candidates
    come from the R tokens the target emitted most often in the heads' training data (FR-Spec, Zhao et
    al., 2025): the output head then computes R logits instead of V, and the draft's distributions are
    zero elsewhere. Deterministic trees are verified without them, so the output is unchanged. 0 drafts
    from the whole vocabulary; None (the default) takes the heads file's own ``draft_vocab``. With
    ``min_prob`` > 0 a round drafts only the nodes whose path probability under the heads is at least
    that (EAGLE-2's confidence, :func:`~specstack_medusa.tree.confident_nodes`): verify rows for
    candidates the heads doubt are not paid for, and a round they doubt entirely is a plain step.
    Which nodes are drafted never changes the output, only its cost.

    Once priced (:meth:`price`: the tuner tells it what the level above's forward of 1, 2, … tokens costs), a
    round drafts only the nodes that pay (:func:`~specstack.speedup.paying_nodes`): the likeliest ones, as
    many as maximise the tokens a round emits per second, each node's chance of acceptance taken as its path
    probability times its depth's calibration (:class:`~specstack_medusa.tree.DepthCalibration`: how often the
    level above accepted a node at that depth against the path probabilities it was shown there). What is drafted
    depends on earlier rounds only, never on the level's draws in this one, so verification stays exact.

    With a draw temperature τ > 0 (``draft_temperature``; ``"follow"`` takes the stack's T where the stack samples,
    T > 0 and not coupled, and 0 elsewhere; :meth:`attach_sampling`) the candidates are drawn instead: a node's
    children are its first draws without replacement (Gumbel top-k, Kool et al., 2019) from softmax(logits / τ) of
    the state it leads to, and the draft is a tree sampled without replacement, verified by Sequoia's rule against
    those distributions (EAGLE's sampled drafting, Li et al., 2024). That rule accepts a draw x with min(1, p(x) / q(x))
    where a top rank is accepted with p(x) alone: at T = 0.6 the chained head's first step drawn at τ = 0.6 was
    accepted at 0.51 on Austen and 0.35 on the Bible, its top rank at 0.43 and 0.33 (four candidates: 0.73 against
    0.68, 0.60 against 0.57; docs/medusa.md, "Drawn candidates"). Which nodes are drafted is decided depth by depth
    from the probabilities of their ranks, before anything at that depth is drawn, so a node's presence never depends
    on its own draw (:meth:`_drawn`).

    Chained heads grow the tree depth by depth and stop at a depth none of whose nodes is worth verifying. The drafter
    takes its heads over: it moves them to the level's device and, on the CPU, gives their linears the few-row kernel
    over their weights rounded to bf16 (:func:`~specstack_medusa.heads.stream_on_cpu`)."""

    name: ClassVar[str] = "medusa"
    requires: ClassVar[frozenset[Capability]] = frozenset({Capability.HIDDEN_STATES})

    vocab: int
    heads: str | MedusaHeads | None = None
    tree_size: int = attrs.field(default=4, validator=_size)  # measured best of 2, 4, 8 on this CPU (docs/results.md)
    top_k: int = attrs.field(default=8, validator=_size)
    draft_vocab: int | None = attrs.field(default=None, validator=_draft_vocab)
    min_prob: float = attrs.field(default=MIN_PROB, validator=_probability)  # drop nodes the heads give a lower path probability
    draft_temperature: float | str = attrs.field(default=0.0, validator=_temperature)  # 0: top ranks; > 0: drawn at it; "follow": the stack's T where it samples
    stats: LevelStats = attrs.field(factory=lambda: LevelStats(name="medusa"))
    _channel: HiddenStateChannel | None = attrs.field(init=False, default=None)
    _trees: dict[int, RankTree] = attrs.field(init=False, factory=dict)  # first head -> its tree of rank paths
    _verify_seconds: tuple[float, ...] = attrs.field(init=False, default=())  # the level above's forward of 1, 2, … tokens (price); (): no pricing
    _calibration: DepthCalibration = attrs.field(init=False, factory=lambda: DepthCalibration(weight=ACCEPTANCE_WEIGHT, retry=RETRY))

    _model: MedusaHeads = attrs.field(init=False)
    _output: object = attrs.field(init=False, default=None)  # [n, H] -> [n, R] logits: the level's output head, or its draft_vocab rows
    _rows: torch.Tensor | None = attrs.field(init=False, default=None)  # [R] the token id of each logit column; None: all V
    _generator: torch.Generator | None = attrs.field(init=False, default=None)  # the stack's, for drawn candidates
    _tau: float = attrs.field(init=False, default=0.0)  # the temperature candidates are drawn at (0: top ranks), from draft_temperature and the stack's sampling

    def __attrs_post_init__(self) -> None:
        self._model = self._load()
        if self.info.vocab_size != self.vocab:
            raise SpecstackError(f"medusa heads were trained for a vocabulary of {self.info.vocab_size} tokens but the target has {self.vocab}; "
                                 f"train heads for this target with `specstack train medusa`")
        if self.draft_vocab is None:
            self.draft_vocab = min(self.info.draft_vocab, self.vocab)
        if self.draft_vocab and self._model.token_rank is None:
            raise SpecstackError(f"medusa draft_vocab={self.draft_vocab} needs heads that carry the target's token ranking; "
                                 f"these do not: retrain them with `specstack train medusa`, or use draft_vocab=0")
        self._tau = 0.0 if self.draft_temperature == FOLLOW else float(self.draft_temperature)

    def _load(self) -> MedusaHeads:
        """The draft model ``heads`` names."""
        return self.heads if isinstance(self.heads, MedusaHeads) else load_heads(self.heads or shipped_heads())

    @classmethod
    def conformance_instance(cls, vocab: int) -> "MedusaDrafter":
        """Random heads with token input (as the shipped heads) for the conformance suite's synthetic models (hidden size 8)."""
        return cls(vocab=vocab, heads=synthetic_heads(vocab, token_input=True), tree_size=8)

    @property
    def info(self) -> HeadsInfo:
        return self._model.info

    @property
    def draft_kind(self) -> DraftKind:
        return DraftKind.TREE_WITHOUT_REPLACEMENT if self._tau else DraftKind.TREE_DETERMINISTIC

    def attach_sampling(self, sampling: SamplingConfig, generator: torch.Generator) -> None:
        """``"follow"`` draws at the stack's temperature where each position's token is sampled, and takes top ranks
        where it is a function of the logits (greedy, or coupled): a coupled race's winner is no draw of softmax(logits / T)."""
        self._generator = generator
        if self.draft_temperature == FOLLOW:
            self._tau = 0.0 if sampling.deterministic else sampling.temperature

    @property
    def vocab_size(self) -> int:
        return self.vocab

    @property
    def step(self) -> int:
        return self.info.heads + 1

    def attach_hidden_states(self, channel: HiddenStateChannel) -> None:
        if channel.hidden_size != self.info.hidden_size:
            raise SpecstackError(f"medusa heads read hidden states of size {self.info.hidden_size} but the level they draft for has {channel.hidden_size}; "
                                 f"train heads for this target with `specstack train medusa`")
        self._channel = channel
        self._model.to(channel.device)
        stream_on_cpu(self._model)
        self._output, self._rows = channel.output_logits, None
        if self.draft_vocab:
            self._rows = self._model.token_rank[: self.draft_vocab].to(channel.device)  # [R]
            self._output = channel.output_head(self._rows)

    def price(self, verify_seconds: Sequence[float]) -> bool:
        self._verify_seconds = tuple(verify_seconds)
        self.reset()
        return True

    def reset(self) -> None:
        self._calibration = DepthCalibration(weight=ACCEPTANCE_WEIGHT, retry=RETRY)  # equal seeds, equal drafts

    def observe(self, drafted: int, accepted: int) -> None:
        if drafted:
            self._calibration.observe(accepted)

    def propose(self, prefix: Sequence[int], n: int) -> Draft:
        self._calibration.show([], [], [])  # until a priced draft is made
        if self._channel is None:
            raise SpecstackError("the medusa drafter reads the hidden states of the level above it; use it at level 0 of a stack")
        found = self._channel.latest(prefix)
        if found is None or n < 1:
            return Draft.empty(self.vocab, device=self._channel.device)
        position, state = found
        self._found(prefix, position)
        first = len(prefix) - 1 - position  # 0: the LM head drafts the next token; 1: head 1 does
        draft = self._draft(state, prefix[-1] if first == 1 else None, first, n)
        self.stats.drafted += len(draft)
        return draft

    def _found(self, prefix: Sequence[int], position: int) -> None:
        """A round drafts from the level's state at ``position``: nothing to do here; a drafter with state of its own
        (the EAGLE drafter's committed rows) brings it up to that position."""

    def _draft(self, state: torch.Tensor, after: int | None, first: int, n: int) -> Draft:
        """The tree of candidates at most ``n`` deep for head ``first`` on (depth 0), from the hidden state
        ``state`` [H] and ``after``, the token after its position when the prefix holds it: of its nodes, those worth
        verifying (:meth:`_worth`). Chained heads stop growing it at a depth none of whose nodes is worth it."""
        tree = self._tree(first).cut(n)
        if not tree:  # no rank of the first head was ever right: nothing worth drafting
            return Draft.empty(self.vocab, device=self._channel.device)
        with torch.inference_mode():
            if self._tau:
                return self._drawn(state, after, first, tree)
            nodes = self._chained_nodes if self.info.chained else self._parallel_nodes
            picks, rows, node_probs = nodes(state, after, first, tree)  # [k'], [k', R], k' floats (k' <= k: the nodes grown)
        depths, parents = tree.depth[: len(node_probs)], tree.parent[: len(node_probs)]
        path, kept, worth = self._worth(node_probs, depths, parents)
        if self._verify_seconds:
            self._calibration.show(path, depths, worth)
            self._calibration.priced_out({depths[i] for i in kept} - {depths[i] for i in worth})
        index = torch.tensor(worth, dtype=torch.long, device=picks.device)  # [m]
        return self._tree_draft(picks[index], rows[index], worth, parents)

    def _tree_draft(self, picks: torch.Tensor, rows: torch.Tensor, nodes: list[int], parents: Sequence[int]) -> Draft:
        """The draft of ``nodes`` (tree order, closed under parents) with their candidates [m] and the distributions
        they came from [m, R], both over the draft vocabulary; empty where no node is."""
        if not nodes:
            return Draft.empty(self.vocab, device=self._channel.device)
        return Draft(tokens=self._ids(picks), probs=self._spread(rows), kind=self.draft_kind,  # [m], [m, V]
                     parents=torch.tensor(subtree_parents(nodes, parents), dtype=torch.long, device=picks.device))  # [m]

    def _drawn(self, state, after, first, tree: RankTree) -> Draft:
        """The tree of drawn candidates (draw temperature τ > 0), grown depth by depth from the root. At each depth
        the nodes worth verifying are chosen first (:meth:`_worth`, over the nodes kept above and this depth's), each
        node priced by the probability of its rank in its parent's distribution softmax(logits / τ): known before
        anything at the depth is drawn, so no node's presence depends on its own draw. Each parent then gives its kept
        children its first draws without replacement from that distribution (Gumbel top-k), in rank order. A depth's
        nodes stay whatever the depths below bring (they are drawn), and the tree stops at a depth where none is kept."""
        if self._generator is None:
            raise SpecstackError("medusa candidates drawn at a temperature take the stack's generator; use the drafter at level 0 of a stack")
        chained = self.info.chained
        frontier = self._begin(state, after, first) if chained else state[None]  # [1, H]
        if not chained:  # parallel heads: every depth's distribution at once, one pass of the output head
            heads = torch.cat([state[None], self._head_states(state, after)])[first : first + tree.depths]  # [d, H]
            dists = torch.softmax(self._output(heads) / self._tau, dim=-1)  # [d, R]
        node_probs, kept, above, picks, rows = [0.0] * len(tree), [], [-1], [], []  # above: the parents of this depth (-1: the root)
        path = node_probs
        for depth in range(tree.depths):
            here = [i for i in tree.at(depth) if tree.parent[i] in above]
            if not here:
                break
            dist = torch.softmax(self._output(frontier) / self._tau, dim=-1) if chained else dists[depth : depth + 1]  # [f, R]
            slot = [above.index(tree.parent[i]) if chained else 0 for i in here]  # each node's parent's row of dist
            take, path = self._chosen_at(tree, depth, here, dist.topk(min(self.top_k, dist.shape[-1])).values.tolist(), slot, node_probs)
            if not take:
                break
            pick, row_of = self._first_draws(dist, [tree.parent[i] for i in take], [slot[here.index(i)] for i in take])  # [n], [n]
            picks.append(pick)
            rows.append(dist[row_of])  # [n, R]: each node's parent's distribution, siblings alike
            kept += take
            if chained and depth + 1 < tree.depths:
                frontier = self._advance(frontier, row_of, self._ids(pick))  # [n, H]: the states the drawn tokens lead to
            above = take
        if self._verify_seconds:
            self._calibration.show(path, tree.depth, kept)
        if not kept:
            return Draft.empty(self.vocab, device=self._channel.device)
        return self._tree_draft(torch.cat(picks), torch.cat(rows), kept, tree.parent)

    def _chosen_at(self, tree: RankTree, depth: int, here: list[int], ranked: list[list[float]], slot: list[int],
                   node_probs: list[float]) -> tuple[list[int], list[float]]:
        """Of ``here``, a depth's candidate nodes (their parents' rows ``slot`` of ``ranked``, each row's rank
        probabilities), the ones worth verifying among those kept above (:meth:`_worth`), and every node's path
        probability. ``node_probs`` (every node's, 0 where not drafted) takes this depth's: a rank's probability for
        the kept, 0 for the others, so that they price nothing below."""
        for i, row in zip(here, slot):
            node_probs[i] = ranked[row][tree.rank[i]]
        end = here[-1] + 1
        path, confident, worth = self._worth(node_probs[:end], tree.depth[:end], tree.parent[:end])
        worth = set(worth)
        take = [i for i in here if i in worth]
        for i in set(here) - set(take):
            node_probs[i] = 0.0
        if self._verify_seconds and not take and set(here) & set(confident):
            self._calibration.priced_out({depth})
        return take, path

    def _first_draws(self, dist: torch.Tensor, parents: list[int], slots: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Nodes with ``parents`` (siblings in rank order) whose parents' distributions are ``dist`` rows ``slots``: a
        parent's j-th child takes the parent's j-th draw without replacement (:func:`~specstack.sampling.draw_without_replacement`
        with the stack's generator; each parent its own draws). -> tokens [n] (draft vocabulary), rows [n]."""
        tokens = [draw_without_replacement(dist[row], parents.count(parent), self._generator) for parent, row in dict(zip(parents, slots)).items()]
        row_of = torch.tensor(slots, dtype=torch.long, device=dist.device)  # [n]
        return torch.cat(tokens), row_of  # siblings are contiguous in tree order, so the draws line up with them

    def _worth(self, node_probs: Sequence[float], depths: Sequence[int], parents: Sequence[int]) -> tuple[list[float], list[int], list[int]]:
        """Of nodes with the heads' probabilities ``node_probs`` of their own tokens (and their ``depths`` and
        ``parents``): their path probabilities, the nodes kept by ``min_prob``, and of those the ones worth verifying:
        all of them unpriced; once priced, the ones that pay at the priced costs by their calibrated chances."""
        path, kept = path_probabilities(node_probs, parents), confident_nodes(node_probs, parents, self.min_prob)
        if not self._verify_seconds:
            return path, kept, kept
        return path, kept, paying_nodes(self._calibration.reach(path, depths, parents), kept, self._verify_seconds)

    def _parallel_nodes(self, state, after, first, tree: RankTree) -> tuple[torch.Tensor, torch.Tensor, list[float]]:
        """Parallel heads: every node's token is a rank of its depth's head, whatever its parent; the output head runs
        once for all depths. -> each node's candidate [k] and the distribution it was taken from [k, R] (indices of the
        draft vocabulary), and each node's probability of it."""
        states = torch.cat([state[None], self._head_states(state, after)])  # [K+1, H]
        top, dist = self._candidates(states[first : first + tree.depths])  # [d, top_k], [d, R]
        depth = torch.tensor(tree.depth, dtype=torch.long, device=state.device)  # [k]
        picks, rows = top[depth, torch.tensor(tree.rank, dtype=torch.long, device=state.device)], dist[depth]  # [k], [k, R]
        return picks, rows, rows.gather(1, picks[:, None])[:, 0].tolist()

    def _chained_nodes(self, state, after, first, tree: RankTree) -> tuple[torch.Tensor, torch.Tensor, list[float]]:
        """Chained heads: a node's children are ranks of the state that its parent's token leads to (one step of the
        head and one pass of the output head per depth, over that depth's parents). The tree grows depth by depth
        while a node of the last depth grown is worth verifying (a deeper node's path probability is at most its
        parent's). -> as :meth:`_parallel_nodes`, for the nodes grown."""
        device = state.device
        frontier = self._begin(state, after, first)  # [1, H]: depth 0's parent
        picks, rows, node_probs = [], [], []
        for d in range(tree.depths):
            top, dist = self._candidates(frontier)  # [f, top_k], [f, R]
            slot = torch.tensor(tree.slots(d), dtype=torch.long, device=device)  # [m] each node's parent's row of frontier
            pick = top[slot, torch.tensor([tree.rank[i] for i in tree.at(d)], dtype=torch.long, device=device)]  # [m]
            picks.append(pick)
            rows.append(dist[slot])  # [m, R]
            node_probs += rows[-1].gather(1, pick[:, None])[:, 0].tolist()
            if d + 1 == tree.depths or not self._grows(node_probs, tree, d):
                break
            frontier = self._advance(frontier, slot, self._ids(pick))  # [m, H]: the states this depth's tokens lead to
        return torch.cat(picks), torch.cat(rows), node_probs  # [k'], [k', R]

    def _grows(self, node_probs: list[float], tree: RankTree, depth: int) -> bool:
        """Whether a node of ``depth`` (the last grown) is worth verifying among the nodes grown so far."""
        k = len(node_probs)
        _, _, worth = self._worth(node_probs, tree.depth[:k], tree.parent[:k])
        return bool(worth) and worth[-1] >= tree.at(depth).start

    def _candidates(self, states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[f, H] states -> their ``top_k`` candidates [f, top_k] (best first) and their distributions [f, R], both
        over the draft vocabulary (:meth:`_ids` turns its indices into token ids)."""
        logits = self._output(states)  # [f, R]
        return logits.topk(min(self.top_k, logits.shape[-1])).indices, torch.softmax(logits, dim=-1)  # [f, top_k], [f, R]

    def _ids(self, picks: torch.Tensor) -> torch.Tensor:
        """[m] indices of the draft vocabulary -> [m] token ids."""
        return picks if self._rows is None else self._rows[picks]

    def _spread(self, rows: torch.Tensor) -> torch.Tensor:
        """[m, R] distributions over the draft vocabulary -> [m, V] over the whole vocabulary (zero outside it)."""
        return rows if self._rows is None else rows.new_zeros(rows.shape[0], self.vocab).index_copy_(1, self._rows, rows)

    def _begin(self, state: torch.Tensor, after: int | None, first: int) -> torch.Tensor:
        """Chained heads: the parent [1, H] of the tree's depth 0, from the level's state [H] at q: that state when
        the LM head drafts depth 0 (``first`` 0), else the state x_{q+1} (``after``) leads to."""
        if first == 0:
            return state[None]
        return self._step(state[None], torch.tensor([after], device=state.device))  # [1, H]

    def _advance(self, frontier: torch.Tensor, slot: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Chained heads: the states [m, H] that ``tokens`` [m] lead to, each after its parent's row ``slot`` [m]
        of the last depth's states ``frontier`` [f, H]."""
        return self._step(frontier[slot], tokens)  # [m, H]

    def _step(self, states: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Chained heads' one step: [m, H] states and [m] the tokens after them -> [m, H] the next states."""
        embedded = self._embedded(tokens)  # [m, H]
        return self._model.step(states.to(embedded.dtype), embedded).to(states.dtype)  # [m, H]

    def _embedded(self, tokens: torch.Tensor) -> torch.Tensor:
        """[m] token ids -> [m, H] the level's input embeddings of them, in the heads' dtype."""
        return self._channel.input_embeddings(tokens).to(next(self._model.parameters()).dtype)  # [m, H]

    def _head_states(self, state: torch.Tensor, after: int | None) -> torch.Tensor:
        """[H] the level's state at q -> [K, H] the heads' states. Heads with token input also read the
        embedding of x_{q+1}: ``after`` when the prefix holds it, else the level's own greedy choice
        from ``state`` (the LM head's top-1, which the tree takes as certain)."""
        dtype = next(self._model.parameters()).dtype
        embedded = None
        if self.info.token_input:
            if after is None:
                after = int(self._channel.output_logits(state[None]).argmax())
            embedded = self._embedded(torch.tensor([after], device=self._channel.device))  # [1, H]
        return self._model(state[None].to(dtype), embedded)[:, 0].to(state.dtype)  # [K, H]

    def _tree(self, first: int) -> RankTree:
        """The tree of rank paths when head ``first`` drafts depth 0: the LM head's top-1 is the level's own greedy
        choice, so it is taken as certain. Built once per ``first``."""
        if first not in self._trees:
            measured = [list(row) for row in self.info.accuracy] or [list(UNTRAINED_ACCURACY)] * self.info.heads
            table = [row[: min(self.top_k, self.vocab)] for row in ([[1.0]] + measured)[first:]]
            self._trees[first] = RankTree.of(choose_paths(table, self.tree_size))
        return self._trees[first]

    def level_stats(self) -> list[LevelStats]:
        return [self.stats]
