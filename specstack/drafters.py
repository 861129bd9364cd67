"""Drafters: anything that proposes tokens together with the distribution it drew them from.

:class:`ModelDrafter` samples autoregressively from a model; :class:`PromptLookupDrafter` copies the
continuation of an earlier occurrence of the last few tokens (free, and strong on long repetitive
contexts). A stack level that verifies a drafter is itself a drafter (:class:`specstack.stack.SpeculativeLevel`).
"""

from __future__ import annotations

import abc
import time
from typing import ClassVar, Sequence

import attrs
import numpy as np
import torch

from .channels import HiddenStateChannel
from .errors import SpecstackError
from .model import CachedModel
from .ngrams import LOOKBACK, NgramIndex, by_agreement
from .sampling import RaceNoise, SamplingConfig, first_argmax, one_hot, sample, warp
from .speedup import best_length
from .types import Capability, Draft, DraftKind, LevelStats, TokenView, as_tokens


class Drafter(abc.ABC):
    """Proposes continuations of a token sequence.

    ``propose(prefix, n)`` returns a :class:`Draft` of (about) ``n`` tokens continuing ``prefix``, each
    with the distribution it was drawn from; fewer when a stop token was drafted or nothing could be
    proposed. ``step`` is the number of tokens the drafter naturally produces per call.

    ``draft_kind`` says how its drafts are drawn (a chain, or a token tree with or without
    replacement, or a deterministic one; :class:`~specstack.types.DraftKind`): the stack picks a
    verifier that verifies that kind losslessly. A tree drafter's ``propose(prefix, n)`` returns a tree
    of depth at most ``n``. ``requires`` lists what the *verifying* level's model must provide.

    Inside a stack ``prefix`` is a :class:`~specstack.types.TokenView` of the generation's shared
    sequence (any ``Sequence[int]`` works; ``np.asarray(prefix)`` copies it). A drafter may write
    its own tokens into ``prefix.sequence`` behind the prefix (``prefix.sequence.write(len(prefix),
    …)``), never before it: :class:`ModelDrafter` does, so that its model compares O(γ) tokens a step.
    """

    name: ClassVar[str]
    requires: ClassVar[frozenset[Capability]] = frozenset()
    draft_kind: DraftKind = DraftKind.CHAIN
    step: int = 1

    @property
    @abc.abstractmethod
    def vocab_size(self) -> int: ...

    @abc.abstractmethod
    def propose(self, prefix: Sequence[int], n: int) -> Draft: ...

    @abc.abstractmethod
    def level_stats(self) -> list[LevelStats]:
        """Counters of this drafter and of every level below it, lowest level first."""

    def reset(self) -> None:
        """Forget all cached state (called at the start of each generation)."""

    def prefill(self, prompt: Sequence[int]) -> None:
        """Process the prompt ahead of decoding (optional: drafting catches up lazily anyway)."""

    def observe(self, drafted: int, accepted: int) -> None:
        """How the level above judged this drafter's last draft (used by refreshable caches)."""

    def price(self, verify_seconds: Sequence[float]) -> bool:
        """Told what the level above's forward of 1, 2, … tokens costs (``verify_seconds[t]``: t + 1 tokens; the tuner
        measures them). True where the drafter then chooses what to draft itself (a chain's length, a tree's nodes), so
        that the level's γ is only a cap on the draft's depth; the default: False, the costs unused."""
        return False

    def attach_hidden_states(self, channel: HiddenStateChannel) -> None:
        """Called once when the stack is built, for a drafter whose ``requires`` holds
        ``Capability.HIDDEN_STATES``: the channel to the hidden states of the level it drafts for."""

    def attach_sampling(self, sampling: SamplingConfig, generator: torch.Generator) -> None:
        """Called once when the stack is built, before its verifiers are chosen, for a drafter given to level 0
        ready-made: the stack's sampling settings and the generator of the device the level above runs on, which the
        stack seeds at every generation. A drafter that samples its drafts draws from it (its draws then follow the
        seed, and never reuse the verifier's numbers), and may choose its ``draft_kind`` by the settings. A drafter serves
        the stack built last with it (as its hidden-state channel does): build each stack with drafters of its own."""


@attrs.define(eq=False, kw_only=True)
class ModelLevel(Drafter):
    """A drafter backed by a model over its own cache view, sampling with the stack's settings."""

    lm: CachedModel
    sampling: SamplingConfig
    generator: torch.Generator
    stop_tokens: frozenset[int] = frozenset()
    noise: RaceNoise = attrs.field(factory=RaceNoise, init=False)  # coupled sampling's noise rows, by position

    def warp(self, logits: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """This level's distributions [..., V] for ``logits`` [..., V] predicting the tokens at ``positions`` [...] (CPU
        int64; what a coupled race reads its noise at)."""
        if not self.sampling.coupled:
            return warp(logits, self.sampling)
        return warp(logits, self.sampling, seed=self.generator.initial_seed(), positions=positions, noise=self.noise)

    @property
    def vocab_size(self) -> int:
        return self.lm.model.vocab_size

    def observe(self, drafted: int, accepted: int) -> None:
        self.lm.observe(drafted, accepted)

    def level_stats(self) -> list[LevelStats]:
        return [self.lm.stats]  # a level with levels below it adds theirs

    def _accounted(self) -> float:
        """Seconds already counted at or below this level: every forward, gather and bookkeeping (what a call's time
        outside them, its own bookkeeping, is measured against)."""
        return sum(stats.forward_seconds + stats.gather_seconds + stats.bookkeeping_seconds for stats in self.level_stats())

    def reset(self) -> None:
        self.lm.reset()

    def prefill(self, prompt: Sequence[int]) -> None:
        self.lm.logits(prompt, 1)


@attrs.define(eq=False, kw_only=True)
class ModelDrafter(ModelLevel):
    """Autoregressive sampling from a model over its cache view: level 0 of most stacks, and the
    whole of a depth-1 (plain autoregressive) stack."""

    name: ClassVar[str] = "model"

    def propose(self, prefix: Sequence[int], n: int) -> Draft:
        """Draw up to ``n`` tokens one forward at a time; the time spent outside the forwards (sampling, the loop) is
        this level's bookkeeping (``LevelStats.bookkeeping_seconds``), which the tuner prices with each drafted token."""
        began, accounted = time.perf_counter(), self._accounted()
        draft = self._draft(as_tokens(prefix), n)
        self.lm.stats.bookkeeping_seconds += time.perf_counter() - began - (self._accounted() - accounted)  # its sampling, this level's own
        return draft

    def _draft(self, context: TokenView, n: int) -> Draft:
        tokens, rows = [], []
        for _ in range(n):
            logits = self.lm.logits(context, 1)  # [1, V]
            if self.sampling.greedy:  # warp's one-hot row marks the first argmax: the rows are made at once below
                tokens.append(int(first_argmax(logits[0])))
            else:
                rows.append(self.warp(logits, torch.tensor([len(context)], device="cpu"))[0])  # [V]; coupled: the draw at position len(context)
                tokens.append(int(first_argmax(rows[-1])) if self.sampling.deterministic else sample(rows[-1], self.generator))  # a one-hot warp's draw is its argmax
            context = context.sequence.write(len(context), tokens[-1:])  # behind the prefix: this call's own positions
            if tokens[-1] in self.stop_tokens:
                break
        self.lm.stats.drafted += len(tokens)
        drafted = torch.tensor(tokens, dtype=torch.long, device=self.lm.device)  # [k]
        probs = one_hot(drafted, self.vocab_size) if self.sampling.greedy else torch.stack(rows)  # [k, V] on this level's device
        return Draft(tokens=drafted, probs=probs)


@attrs.define(eq=False, kw_only=True)
class LookupFirstDrafter(ModelDrafter):
    """A draft model that lets prompt lookup draft first: where the context's last tokens occurred
    before, lookup's copied chain is the draft, and the model (a one-layer draft over a StreamingLLM
    window, say, which cannot copy from far back) drafts only where nothing matches.

    Lossless for any ``lookup``: which part drafts is a function of the committed prefix alone, never
    of a random draw, so every round is an ordinary speculative round with that part's chain and its
    proposal distribution (one-hot for lookup, the model's warped rows for the model). The model's
    cache catches up on the tokens it did not draft when it drafts next (:meth:`CachedModel.logits`
    feeds what it has not seen), and only it hears the verdicts on its own drafts (``observe``).
    Level 0 of ``triforce-hybrid``: TriForce's draft (Sun et al., 2024) with prompt lookup (Saxena, 2023).
    """

    name: ClassVar[str] = "lookup+model"

    lookup: Drafter
    _model_drafted: bool = attrs.field(init=False, default=False)  # whether the last draft was the model's

    def __attrs_post_init__(self) -> None:
        if self.lookup.draft_kind is not DraftKind.CHAIN or isinstance(self.lookup, ModelLevel):
            raise SpecstackError(f"lookup-first drafting takes a model-free chain drafter; got {type(self.lookup).__name__}")

    def reset(self) -> None:
        self.lookup.reset()
        super().reset()

    def prefill(self, prompt: Sequence[int]) -> None:
        self.lookup.prefill(prompt)
        super().prefill(prompt)

    def propose(self, prefix: Sequence[int], n: int) -> Draft:
        draft = self.lookup.propose(prefix, n)
        self._model_drafted = len(draft) == 0
        if self._model_drafted:
            return super().propose(prefix, n)
        self.lm.stats.drafted += len(draft)  # this level's count: lookup's tokens and the model's
        return draft  # on the CPU: the verifying level moves it

    def observe(self, drafted: int, accepted: int) -> None:
        if self._model_drafted:
            super().observe(drafted, accepted)


# A priced lookup's running chances per key (a match length; a tree branch's length and rank) and draft position:
ACCEPTANCE_PRIOR = 0.5  # where an estimate starts
ACCEPTANCE_WEIGHT = 0.1  # how far each decided continuation moves an estimate toward its outcome


def fold_outcomes(rates: list[float], hits: Sequence[bool]) -> None:
    """Move the running chance of each examined position ``ACCEPTANCE_WEIGHT`` of the way to its outcome
    (``hits[i]``: position i accepted); a position first examined starts from the deepest estimate."""
    for i, hit in enumerate(hits):
        if i == len(rates):
            rates.append(rates[-1])
        rates[i] += ACCEPTANCE_WEIGHT * (hit - rates[i])


def fold_agreement(rates: list[float], continuation: Sequence[int], written: Sequence[int]) -> None:
    """Fold into ``rates`` what the text ``written`` after a draft says of a lookup's ``continuation``, drafted or not:
    at each position the text reached while agreeing with it, whether its token was the text's. With one-hot drafts
    that is the chance the level above accepts it there: it accepts a drafted token exactly when its own draw is it."""
    missed = next((i for i, (a, b) in enumerate(zip(continuation, written)) if a != b), None)
    seen = min(len(continuation), len(written)) if missed is None else missed + 1
    fold_outcomes(rates, [i != missed for i in range(seen)])


@attrs.define(eq=False)
class LookupChances:
    """A priced lookup's chances that the text follows what it drafts from, per key and position (``rates``), read off
    the text: each continuation it drafted from (drafted tokens or not) is kept until the text written after it decides
    it, over as many rounds as that takes: the text left it at some position, ran its whole length, or was rolled back
    into what it had written of it (a stack's rejection above the level). Then each position the text reached is folded
    into the key's chances (:func:`fold_agreement`). So a continuation's deeper positions are measured too where a round
    drafts few of its tokens, or none (one token written a round). At most γ continuations a round are shown, each
    decided within γ rounds: O(γ²) a round."""

    rates: dict[object, list[float]] = attrs.field(factory=dict)  # key -> the chance at each position seen
    _pending: list[tuple[object, tuple[int, ...], int, int]] = attrs.field(factory=list)  # (key, continuation, the text length it continues, tokens of it the text has followed)

    def clear(self) -> None:
        self.rates.clear()
        self._pending.clear()

    def rate(self, key: object, position: int) -> float:
        """The chance that the text follows a continuation of ``key`` at ``position`` once it followed it there; a
        position not yet seen taken as the deepest one seen."""
        rates = self.rates.get(key, [ACCEPTANCE_PRIOR])
        return rates[min(position, len(rates) - 1)]

    def show(self, key: object, continuation: Sequence[int], at: int) -> None:
        """A continuation of the text's first ``at`` tokens; one shown again there (a lookup asked twice) replaces it."""
        self._pending = [entry for entry in self._pending if entry[0] != key or entry[2] != at]
        self._pending.append((key, tuple(continuation), at, 0))

    def read(self, text: np.ndarray, unchanged: int) -> None:
        """Fold into the chances what ``text`` [L] decides; ``unchanged``: how long a prefix of the text last read is
        still there."""
        pending, self._pending = self._pending, []
        for key, continuation, at, followed in pending:
            if unchanged < at + followed:  # rolled back into what the text had followed of it: decided on that
                written = list(continuation[:followed])
            else:
                written = text[at : at + len(continuation)].tolist()
                if len(written) < len(continuation) and written == list(continuation[: len(written)]):
                    self._pending.append((key, continuation, at, len(written)))  # followed so far: undecided
                    continue
            fold_agreement(self.rates.setdefault(key, [ACCEPTANCE_PRIOR]), continuation, written)


@attrs.define(eq=False, kw_only=True)
class PromptLookupDrafter(Drafter):
    """Prompt-lookup (n-gram) drafting (Saxena, 2023): find an earlier occurrence of the last
    ``max_ngram`` … ``min_ngram`` tokens and propose what followed it. Of the latest CANDIDATES occurrences
    of the longest n-gram that occurred, the one whose preceding tokens agree longest with the text's
    (compared up to ``lookback`` tokens back from the match's end; ties: the latest) is drafted from: where a
    text copies an earlier passage, that passage's occurrence rather than the latest one of its last three
    tokens. ``lookback=0`` takes the latest occurrence, Saxena's rule. Deterministic, so the proposal
    distribution is one-hot; when nothing matches the draft is empty and the level above samples on
    its own.

    The search is incremental (:class:`~specstack.ngrams.NgramIndex`): each call indexes only the tokens
    appended since the last one and unindexes those rolled back, then looks the last n-grams up: O(γ)
    per round, no scan of the context.

    Once priced (:meth:`price`: the tuner tells it what the level above's forward of 1, 2, … tokens costs), it
    drafts only as many of the matched tokens as pay: the length :func:`specstack.speedup.best_length` picks from
    those costs and from the chance, for matches of the same length, that the text follows a match at each position
    (a running estimate, ACCEPTANCE_WEIGHT of the way to each round's outcome; a position not yet seen taken as the
    deepest one seen). The chances are read off the text the level above writes after each draft, over the rounds
    until it leaves the match or runs its length (:class:`LookupChances`), for every matched token, drafted or
    not, so a match length priced out goes on being measured and is drafted again once the text follows its matches
    (as the lookup tree learns). What is drafted depends on earlier rounds only, never on the level's draws in this
    one, so verification stays exact.
    """

    name: ClassVar[str] = "prompt-lookup"

    vocab: int
    max_ngram: int = 3
    min_ngram: int = 1
    lookback: int = LOOKBACK
    stats: LevelStats = attrs.field(factory=lambda: LevelStats(name="prompt-lookup"))
    _index: NgramIndex = attrs.field(init=False)
    _verify_seconds: tuple[float, ...] = attrs.field(init=False, default=())  # the level above's forward of 1, 2, … tokens (price); () drafts all
    _chances: LookupChances = attrs.field(init=False, factory=LookupChances)  # per match length (priced only)

    def __attrs_post_init__(self) -> None:
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise SpecstackError(f"n-gram range {self.min_ngram}..{self.max_ngram} is not allowed; need 1 <= min_ngram <= max_ngram")
        if isinstance(self.lookback, bool) or not isinstance(self.lookback, int) or self.lookback < 0:
            raise SpecstackError(f"prompt lookup's lookback {self.lookback!r} is not allowed; use a whole number >= 0 (0: the latest occurrence)")
        self._index = NgramIndex(max_ngram=self.max_ngram, min_ngram=self.min_ngram)

    @property
    def vocab_size(self) -> int:
        return self.vocab

    def reset(self) -> None:
        self._index.clear()
        self._chances.clear()  # equal seeds, equal drafts

    def price(self, verify_seconds: Sequence[float]) -> bool:
        self._verify_seconds = tuple(verify_seconds)
        self._chances.clear()
        return True

    def prefill(self, prompt: Sequence[int]) -> None:
        self._index.catch_up(as_tokens(prompt))

    def propose(self, prefix: Sequence[int], n: int) -> Draft:
        prefix = as_tokens(prefix)
        seq = prefix.array()  # [L]
        self._chances.read(seq, self._index.catch_up(prefix))
        tokens, matched = self._lookup(seq, n)
        if self._verify_seconds and tokens:
            self._chances.show(matched, tokens, seq.shape[0])
            tokens = tokens[: self._paying(matched, len(tokens))]
        self.stats.drafted += len(tokens)
        ids = torch.tensor(tokens, dtype=torch.long, device="cpu")  # [k]; model-free: the verifying level moves it
        probs = torch.zeros(len(tokens), self.vocab, device="cpu").scatter_(1, ids[:, None], 1.0)  # [k, V]
        return Draft(tokens=ids, probs=probs)

    def _lookup(self, seq: np.ndarray, n: int) -> tuple[list[int], int]:
        """What followed the chosen earlier occurrence of the longest matching suffix n-gram of ``seq`` (up to ``n``
        tokens), and that n-gram's length (0: none matched)."""
        length = seq.shape[0]
        for size in range(min(self.max_ngram, length - 1), self.min_ngram - 1, -1):
            ends = self._index.earlier(seq, size)
            if ends:
                end = by_agreement(seq, ends, self.lookback)[0]
                return seq[end + 1 : end + 1 + n].tolist(), size
        return [], 0

    def _paying(self, matched: int, found: int) -> int:
        """How many of ``found`` tokens from a match of ``matched`` tokens to draft at the priced costs."""
        return best_length([self._chances.rate(matched, i) for i in range(found)], self._verify_seconds)

    def level_stats(self) -> list[LevelStats]:
        return [self.stats]


@attrs.define(eq=False, kw_only=True)
class MergedDrafter(Drafter):
    """The drafts of several model-free drafters (prompt lookup, lookup trees, Medusa heads) as one
    deterministic token tree: their union as a trie, a token each part proposes under the same path
    being proposed once, in the order of ``parts``. Each part keeps what it is good at: prompt lookup
    copies a repetitive text, Medusa heads guess where nothing repeats. With ``first_only`` the draft
    is instead that of the first part that proposes anything: a smaller tree, whose verify costs less.

    Lossless as any ``TREE_DETERMINISTIC`` draft: at T = 0 the greedy verifier follows the level's
    argmax down the tree, and above it the token-tree verifier draws every token from the level's own
    distribution and only descends into a child holding that token, which keeps that distribution
    whatever the candidates are, as long as they do not depend on its draws (docs/trees.md). A node's
    ``probs`` row is the part's that proposed it first; the verifiers do not read it.

    Parts with a model of their own (:class:`ModelLevel`) are refused: their caches learn from the
    verdicts on their own drafts (``observe``), which a merged draft does not give them. A verdict reaches a
    part only when the draft was that part's alone (``first_only``, or the other parts proposed nothing): a
    priced part (:meth:`price`, passed to every part) learns from it what its drafts are accepted.

    A part whose siblings are sampled without replacement (Medusa heads with ``draft_temperature``) makes the
    draft that kind instead, verified by Sequoia's rule, which reads each node's ``probs`` row: then only with
    ``first_only`` (a union would break the order of the draws) and beside chains (verified by the same rule,
    a chain being a tree of one child per node).
    """

    name: ClassVar[str] = "merged"

    parts: tuple[Drafter, ...] = attrs.field(converter=tuple)
    first_only: bool = attrs.field(default=False, validator=lambda _, __, value: _check_flag("first_only", value))
    stats: LevelStats = attrs.field(init=False)
    _sole: Drafter | None = attrs.field(init=False, default=None)  # the one part that proposed the last draft (None: several, or none)

    def __attrs_post_init__(self) -> None:
        if not self.parts or any(isinstance(part, ModelLevel) for part in self.parts):
            raise SpecstackError(f"merged drafts take one or more model-free drafters; got {[type(p).__name__ for p in self.parts]}")
        if len({part.vocab_size for part in self.parts}) != 1:
            raise SpecstackError(f"merged drafters must share a vocabulary; got sizes {[part.vocab_size for part in self.parts]}")
        if not self._carries_draws():
            raise SpecstackError(f"merged drafts take a part that samples its siblings ({', '.join(p.name for p in self.parts)}) only with first_only=true "
                                 f"and beside chains; got kinds {sorted(part.draft_kind.value for part in self.parts)}, first_only={self.first_only}")
        self.stats = LevelStats(name="+".join(part.name for part in self.parts))

    def _carries_draws(self) -> bool:
        """Whether this merge can verify its parts' drafts as they are: sampled siblings only with ``first_only`` and
        beside chains."""
        kinds = {part.draft_kind for part in self.parts}
        return DraftKind.TREE_WITHOUT_REPLACEMENT not in kinds or (self.first_only and not kinds - {DraftKind.CHAIN, DraftKind.TREE_WITHOUT_REPLACEMENT})

    @property
    def draft_kind(self) -> DraftKind:
        """A deterministic tree, or a tree sampled without replacement where a part samples its siblings."""
        sampled = any(part.draft_kind is DraftKind.TREE_WITHOUT_REPLACEMENT for part in self.parts)
        return DraftKind.TREE_WITHOUT_REPLACEMENT if sampled else DraftKind.TREE_DETERMINISTIC

    @property
    def requires(self) -> frozenset[Capability]:
        return frozenset().union(*(part.requires for part in self.parts))

    @property
    def vocab_size(self) -> int:
        return self.parts[0].vocab_size

    @property
    def step(self) -> int:
        return max(part.step for part in self.parts)

    def attach_hidden_states(self, channel: HiddenStateChannel) -> None:
        for part in self.parts:
            if Capability.HIDDEN_STATES in part.requires:
                part.attach_hidden_states(channel)

    def attach_sampling(self, sampling: SamplingConfig, generator: torch.Generator) -> None:
        """Passed to every part. Where a part would then sample its siblings and this merge cannot carry them (a
        union; a deterministic tree beside), the parts are told the stack is deterministic instead, and choose as
        for greedy decoding (a part given a draw temperature of its own was refused when the merge was made)."""
        for part in self.parts:
            part.attach_sampling(sampling, generator)
        if not self._carries_draws():
            for part in self.parts:
                part.attach_sampling(SamplingConfig(), generator)

    def reset(self) -> None:
        self._sole = None
        for part in self.parts:
            part.reset()

    def prefill(self, prompt: Sequence[int]) -> None:
        for part in self.parts:
            part.prefill(prompt)

    def price(self, verify_seconds: Sequence[float]) -> bool:
        return any([part.price(verify_seconds) for part in self.parts])  # every part told, not only up to the first that uses it

    def observe(self, drafted: int, accepted: int) -> None:
        if self._sole is not None:
            self._sole.observe(drafted, accepted)

    def propose(self, prefix: Sequence[int], n: int) -> Draft:
        tokens, parents, rows, nodes = [], [], [], {}  # nodes: (parent, token) -> index in the trie
        proposing = []
        for part in self.parts:
            if self.first_only and tokens:
                break  # the later parts are not asked
            draft = part.propose(prefix, n).to("cpu")
            proposing += [part] if len(draft) else []
            index = []  # the part's node i -> its node in the trie
            for token, parent, row in zip(draft.tokens.tolist(), draft.parent_index().tolist(), draft.probs):
                key = (index[parent] if parent >= 0 else -1, token)
                if key not in nodes:
                    nodes[key] = len(tokens)
                    tokens.append(token)
                    parents.append(key[0])
                    rows.append(row)
                index.append(nodes[key])
        self._sole = proposing[0] if len(proposing) == 1 else None
        self.stats.drafted += len(tokens)
        if not tokens:
            return Draft.empty(self.vocab_size)
        return Draft(tokens=torch.tensor(tokens, dtype=torch.long), probs=torch.stack(rows),  # [k], [k, V]
                     parents=torch.tensor(parents, dtype=torch.long), kind=self.draft_kind)

    def level_stats(self) -> list[LevelStats]:
        return [self.stats]


def _check_flag(name: str, value) -> None:
    if not isinstance(value, bool):
        raise SpecstackError(f"{name} {value!r} is not allowed; use true or false")
