"""Speculation stacks of any depth.

A stack is a chain of levels L0 … Ln. L0 is a plain :class:`~specstack.drafters.Drafter`; every level
above it is a :class:`SpeculativeLevel`, which asks the level below for γ tokens, scores them with
its own model in one forward pass, verifies them, and hands up the tokens it emits *with its own
probabilities* as the proposal distribution. Because a ``SpeculativeLevel`` is itself a ``Drafter``,
depth is recursion: depth 1 is autoregressive decoding, depth 2 classic speculative decoding, depth
3 TriForce (Sun et al., 2024), and deeper stacks need no new code.

Why this is lossless: a verifier emits tokens distributed exactly as its level's distribution p
(speculative sampling, Leviathan et al., 2023, Theorem 1). So the tokens a level hands up are a
sample from p, and p is the right proposal q for the level above. By induction the top level
emits tokens distributed as the target's ``warp(logits)``.
"""

from __future__ import annotations

import operator
import time
from typing import Callable, Sequence

import attrs
import numpy as np
import torch

from .drafters import Drafter, ModelDrafter, ModelLevel
from .errors import SpecstackError
from .model import CachedModel, CausalLM, check_window, weights_held
from .policies import CachePolicy, FullCache
from .sampling import SamplingConfig
from .types import Capability, Draft, DraftKind, GenerationResult, LevelStats, TokenSequence, as_tokens
from .verify import Verifier, check_verdict, default_verifier


@attrs.define(eq=False, kw_only=True)
class SpeculativeLevel(ModelLevel):
    """One verifying level: ``drafter`` below, ``lm`` (a model over its cache view) here. With γ 0
    (below the top only) it drafts nothing: each round is one forward of its own, one token sampled
    from it, and the drafter below idles (a middle level whose drafter costs more than it saves)."""

    name = "speculative-level"

    drafter: Drafter
    verifier: Verifier
    gamma: int

    @property
    def step(self) -> int:
        return self.gamma

    def propose(self, prefix: Sequence[int], n: int) -> Draft:
        """Run rounds until at least ``n`` tokens are emitted (at most ``n + 1``) or a stop token.
        The emitted tokens are written into the shared sequence behind ``prefix`` as they come."""
        prefix = as_tokens(prefix)
        sequence, start = prefix.sequence, len(prefix)
        tokens: list[int] = []
        rows: list[torch.Tensor] = []
        while len(tokens) < n and not (tokens and tokens[-1] in self.stop_tokens):
            emitted, probs = self.round(sequence.view(start + len(tokens)), min(self.gamma, n - len(tokens)))
            sequence.write(start + len(tokens), emitted)
            tokens += emitted
            rows.append(probs)
        cut = next((i + 1 for i, t in enumerate(tokens) if t in self.stop_tokens), len(tokens))
        probs = torch.cat(rows)[:cut]  # [m, V] on this level's device
        return Draft(tokens=torch.tensor(tokens[:cut], dtype=torch.long, device=probs.device), probs=probs)

    def round(self, prefix: Sequence[int], k: int) -> tuple[list[int], torch.Tensor]:
        """One round: draft ``k`` tokens below (a chain, or a tree of depth ``k``), verify them here.
        Returns the emitted tokens and this level's distribution at each of them ([m+1, V])."""
        prefix = as_tokens(prefix)
        began, accounted = time.perf_counter(), self._accounted()
        if k == 0:  # γ 0: nothing drafted, the drafter not asked; the round samples one token from this level's forward
            draft = Draft.empty(self.vocab_size, self.lm.device)
        else:
            draft = self.drafter.propose(prefix, k).head(k).stop_at(self.stop_tokens)  # a lower level may overshoot by one
        draft = draft.to(self.lm.device)  # the level below may sit on another device
        if draft.is_tree:
            logits = self.lm.tree_logits(prefix, draft)  # [k+1, V]
        else:
            drafted = prefix.sequence.write(len(prefix), draft.tokens.tolist())  # a model below wrote them there already
            logits = self.lm.logits(drafted, len(draft) + 1)  # [k+1, V]
        p = self.warp(logits, row_positions(len(prefix), draft))  # [k+1, V]
        verdict = check_verdict(self.verifier.verify(draft, p, self.generator), draft, self.vocab_size, self.verifier.name)
        if draft.is_tree:
            self.lm.accept_path(verdict.accepted)
        m = verdict.num_accepted
        if k:
            self.drafter.observe(len(draft), m)
        emitted, rows = [*draft.tokens[list(verdict.accepted)].tolist(), verdict.next_token], p[verdict.rows()]
        self._count(len(draft), m, bookkeeping=time.perf_counter() - began - (self._accounted() - accounted))
        return emitted, rows

    def _count(self, drafted: int, accepted: int, bookkeeping: float) -> None:
        stats = self.lm.stats
        stats.bookkeeping_seconds += bookkeeping
        stats.rounds += 1
        stats.drafted += drafted
        stats.accepted += accepted
        stats.rejected += accepted < drafted
        stats.emitted += accepted + 1

    def level_stats(self) -> list[LevelStats]:
        return [*self.drafter.level_stats(), self.lm.stats]

    def reset(self) -> None:
        self.drafter.reset()
        self.lm.reset()

    def prefill(self, prompt: Sequence[int]) -> None:
        self.lm.logits(prompt, 1)  # top-down: a gathering level below reads this level's cache
        self.drafter.prefill(prompt)


def row_positions(start: int, draft: Draft) -> torch.Tensor:
    """[k+1] the sequence position each row of a verify's logits predicts: row 0 the token after the prefix (at
    ``start``), row i + 1 the token after draft token i (one past its depth)."""
    return start + torch.cat([torch.zeros(1, dtype=torch.long, device="cpu"), draft.depths() + 1])  # [k+1], host metadata


def _gamma(instance, attribute, value: int | None) -> None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
        raise SpecstackError(f"gamma {value!r} is not allowed; use an integer >= 1 (or 0 below the top level: that level drafts nothing and decodes alone)")


@attrs.frozen(kw_only=True, eq=False)
class Level:
    """The recipe of one level: a model with a cache policy (and γ above level 0), or, at level 0
    only, a ready-made drafter such as prompt lookup. Above level 0, ``verifier`` (default: chosen
    from the kind of draft the level below produces and the sampling settings) verifies its drafts."""

    model: CausalLM | None = None
    policy: CachePolicy = attrs.field(factory=FullCache)
    gamma: int | None = attrs.field(default=None, validator=_gamma)
    drafter: Drafter | None = None
    name: str | None = None
    # level 0 with a model: how it drafts over its cache view, a ModelLevel class (or a partial of one)
    # called with lm=, sampling=, generator=, stop_tokens= (a tree drafter, say)
    model_drafter: Callable[..., Drafter] = ModelDrafter
    verifier: Verifier | None = None  # above level 0: overrides the stack's choice for this level

    def __attrs_post_init__(self) -> None:
        if (self.model is None) == (self.drafter is None):
            raise SpecstackError("a level needs exactly one of model= or drafter=")

    @property
    def vocab_size(self) -> int:
        return self.model.vocab_size if self.model is not None else self.drafter.vocab_size

    def label(self, index: int) -> str:
        return self.name or f"L{index}:{self.policy.name if self.model is not None else self.drafter.name}"


@attrs.define(eq=False)
class Generators:
    """One ``torch.Generator`` per device, all seeded alike: every level draws its random numbers on
    its own model's device, where its probabilities are (a draft on the CPU, the target on a GPU)."""

    seed: int
    _by_device: dict[torch.device, torch.Generator] = attrs.field(init=False, factory=dict)

    def on(self, device: torch.device | str) -> torch.Generator:
        device = _full_device(device)
        if device not in self._by_device:
            self._by_device[device] = torch.Generator(device=device).manual_seed(self.seed)
        return self._by_device[device]

    def next_seed(self) -> int:
        """The seed after this one in a chain fixed by the first (not by the draws made since): a run of generations
        without a seed is the same run in any stack built with the same seed."""
        return int(np.random.default_rng([self.seed % 2**64, 1]).integers(2**62))

    def manual_seed(self, seed: int) -> None:
        self.seed = seed
        for generator in self._by_device.values():
            generator.manual_seed(seed)

    def synchronize(self) -> None:
        """Wait for the work queued on every accelerator a level uses (before reading a clock)."""
        for device in self._by_device:
            if device.type == "cuda":
                torch.cuda.synchronize(device)


def _full_device(device: torch.device | str) -> torch.device:
    """``cuda`` names the current CUDA device: spell out its index, so that one device has one key."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


PREFILL_CHUNK = 2048


@attrs.define(eq=False)
class SpeculationStack:
    """A built stack. ``generate`` decodes from the top level, which emits the target's distribution."""

    top: Drafter
    target: CausalLM
    sampling: SamplingConfig
    generators: Generators
    stop_tokens: frozenset[int]
    depth: int
    models: tuple[CausalLM, ...] = ()  # the levels' models, lowest first: their weights are held over each generate
    prefill_chunk: int = PREFILL_CHUNK  # prompt tokens per prefill step (each level feeds a chunk, top level first)

    @classmethod
    def build(
        cls,
        levels: Sequence[Level],
        *,
        sampling: SamplingConfig = SamplingConfig(),
        verifier: Verifier | None = None,
        stop_tokens: Sequence[int] = (),
        seed: int = 0,
    ) -> "SpeculationStack":
        """Compose ``levels`` (lowest first; the last one's model is the target) into a stack."""
        _check_levels(levels)
        if verifier is not None:
            verifier.check_sampling(sampling)
        generators = Generators(seed)
        stops = frozenset(stop_tokens)
        lms = _cached_models(levels)
        drafter = levels[0].drafter or levels[0].model_drafter(lm=lms[0], sampling=sampling, generator=generators.on(lms[0].device), stop_tokens=stops)
        if levels[0].drafter is not None:
            drafter.attach_sampling(sampling, generators.on(lms[1].device))
        for index, (level, lm) in enumerate(zip(levels[1:], lms[1:]), start=1):
            chosen = level.verifier or verifier or default_verifier(drafter.draft_kind, sampling)
            _check_verifier(index, level, drafter, chosen, sampling)
            if Capability.HIDDEN_STATES in drafter.requires:
                drafter.attach_hidden_states(lm.open_hidden_channel())
            drafter = SpeculativeLevel(
                drafter=drafter, lm=lm, verifier=chosen, gamma=level.gamma, sampling=sampling,
                generator=generators.on(lm.device), stop_tokens=stops,
            )
        return cls(top=drafter, target=levels[-1].model, sampling=sampling, generators=generators, stop_tokens=stops, depth=len(levels),
                   models=tuple(level.model for level in levels if level.model is not None))

    def generate(self, prompt: Sequence[int], max_new_tokens: int, *, seed: int | None = None, progress=None,
                 reuse_cache: bool = False, prefill_progress=None, after_round: Callable[[int], None] | None = None) -> GenerationResult:
        """Decode up to ``max_new_tokens`` tokens after ``prompt``, stopping after a stop token.

        ``progress(done, total)`` is called after each top-level round, ``prefill_progress(done, total)``
        after each chunk of ``prefill_chunk`` prompt tokens, and ``after_round(emitted)`` after each
        top-level round, before the next is drafted (``specstack.autotune.Retuner`` sets γ there). Each call starts from empty
        caches, so equal seeds give equal outputs; ``reuse_cache=True`` keeps whatever the caches hold
        of this prompt from the previous call (much faster for many samples of one long prompt; still
        lossless, but an evicting cache then starts from a history-dependent view). The models' weights are
        held over the call (:func:`specstack.model.weights_held`): changed from a callback, they are seen at
        the next call."""
        with weights_held(self.models):
            return self._generate(prompt, max_new_tokens, seed=seed, progress=progress, reuse_cache=reuse_cache,
                                  prefill_progress=prefill_progress, after_round=after_round)

    def _generate(self, prompt: Sequence[int], max_new_tokens: int, *, seed: int | None, progress, reuse_cache: bool, prefill_progress,
                  after_round: Callable[[int], None] | None) -> GenerationResult:
        prompt = _check_prompt(prompt, self.target, max_new_tokens)
        _check_seed(seed)
        sequence = TokenSequence(prompt)  # shared by every level: O(1) prefixes, O(γ) comparisons
        if seed is not None:
            self.generators.manual_seed(seed)
        elif self.sampling.coupled:  # a fresh text: the next seed the generators give (the levels' noise follows their seed)
            self.generators.manual_seed(self.generators.next_seed())
        if not reuse_cache:
            self.top.reset()
        self.generators.synchronize()  # clocks are read only when every device is idle
        began = time.perf_counter()
        self._prefill(sequence, len(prompt), prefill_progress, chunked=not reuse_cache)
        self.generators.synchronize()
        prefill_seconds = time.perf_counter() - began
        before = [attrs.evolve(s) for s in self.top.level_stats()]
        began = time.perf_counter()
        tokens: list[int] = []
        while len(tokens) < max_new_tokens and not (tokens and tokens[-1] in self.stop_tokens):
            committed = sequence.view(len(prompt) + len(tokens))
            draft = self.top.propose(committed, min(self.top.step, max_new_tokens - len(tokens)))
            emitted = draft.tokens.tolist()
            sequence.write(len(committed), emitted)  # where the top level wrote them already
            tokens += emitted
            if progress is not None:
                progress(min(len(tokens), max_new_tokens), max_new_tokens)
            if after_round is not None:
                after_round(len(tokens))
        self.generators.synchronize()
        seconds = time.perf_counter() - began
        tokens = tokens[:max_new_tokens]
        stopped = "eos" if tokens and tokens[-1] in self.stop_tokens else "max_new_tokens"
        stats = tuple(after.since(b) for after, b in zip(self.top.level_stats(), before))
        return GenerationResult(
            prompt_length=len(prompt), tokens=tuple(tokens), levels=stats, seconds=seconds,
            prefill_seconds=prefill_seconds, stopped_by=stopped,
        )

    @property
    def top_cache(self) -> CachedModel | None:
        """The top level's model over its cache (what :meth:`share_prefill` copies between stacks), or
        None where the top level has no model."""
        return getattr(self.top, "lm", None)

    def share_prefill(self, source: "SpeculationStack", prompt: Sequence[int]) -> bool:
        """Give this stack's target level ``source``'s cache of ``prompt`` (same target, both over its
        full cache), so that ``generate(prompt, reuse_cache=True)`` prefills only the levels below it:
        stacks compared on one long prompt pay its full prefill once. False where the top levels
        are not both such levels (nothing is copied)."""
        mine, theirs = self.top_cache, source.top_cache
        if mine is None or theirs is None or not mine.can_adopt(theirs):
            return False
        mine.adopt(theirs, prompt)
        return True

    def _prefill(self, sequence: TokenSequence, length: int, progress, *, chunked: bool) -> None:
        """Feed the prompt in chunks: every level's cache only ever extends (a level feeds what it has
        not seen), so activations stay O(chunk) and a long prompt reports its progress. Caches kept
        from an earlier call (or a shared prefill) are fed in one step: a chunk shorter than what a
        level already holds would roll it back."""
        for end in prefill_ends(length, self.prefill_chunk if chunked else length):
            self.top.prefill(sequence.view(end))
            if progress is not None:
                progress(end, length)


def prefill_ends(length: int, chunk: int) -> list[int]:
    """The prompt lengths after each prefill step of ``chunk`` tokens: where a stack's prefill (and
    anything that must reproduce its KV cache bit for bit, like the bf16 certificate's replay) stops."""
    return [*range(chunk, length, chunk), length]


def _cached_models(levels: Sequence[Level]) -> list[CachedModel | None]:
    """One cache view per model level, top first, so that a gathering level can read the full
    cache of the same model above it."""
    lms: list[CachedModel | None] = [None] * len(levels)
    for index in reversed(range(len(levels))):
        level = levels[index]
        if level.model is None:
            continue
        channel = _full_source(levels, lms, index).open_channel() if level.policy.gathers_from_full else None
        lms[index] = CachedModel(level.model, level.policy, LevelStats(name=level.label(index)), channel=channel)
    return lms


def _full_source(levels: Sequence[Level], lms: list, index: int) -> CachedModel:
    for above in range(index + 1, len(levels)):
        if levels[above].model is levels[index].model and levels[above].policy.complete:
            return lms[above]
    raise SpecstackError(f"cache policy '{levels[index].policy.name}' at level {index} needs a level above it with the same model and the full cache")


def _check_levels(levels: Sequence[Level]) -> None:
    if not levels:
        raise SpecstackError("a stack needs at least one level; got an empty list")
    if levels[-1].model is None:
        raise SpecstackError("the top level must be a model (the target), not a model-free drafter")
    for index, level in enumerate(levels):
        if index > 0 and level.drafter is not None:
            raise SpecstackError(f"level {index} has a drafter; only level 0 may be a model-free drafter")
        if index > 0 and level.gamma is None:
            raise SpecstackError(f"level {index} needs gamma (tokens drafted per round), an integer >= 1")
        if index == len(levels) - 1 and level.gamma == 0:
            raise SpecstackError(f"gamma 0 is not allowed at the top level {index}; use an integer >= 1 (a top level that drafts nothing is autoregressive decoding)")
        if level.vocab_size != levels[-1].vocab_size:
            raise SpecstackError(f"level {index} has vocabulary size {level.vocab_size} but the target has {levels[-1].vocab_size}; all levels must share one vocabulary")
        if level.model is not None:
            _check_model(index, level, levels[-1].model)


def _check_model(index: int, level: Level, target: CausalLM) -> None:
    if level.model.tokenizer_id != target.tokenizer_id:
        raise SpecstackError(
            f"level {index} ({_name(level.model)}) uses tokenizer {level.model.tokenizer_id!r} but the target ({_name(target)}) "
            f"uses {target.tokenizer_id!r}; all levels must share the target's tokenizer"
        )
    missing = set(level.policy.requires) - set(level.model.capabilities)
    if missing:
        names = ", ".join(sorted(c.value for c in missing))
        raise SpecstackError(f"cache policy '{level.policy.name}' at level {index} needs {names}, which its model does not provide")


def _check_verifier(index: int, level: Level, drafter: Drafter, verifier: Verifier, sampling: SamplingConfig) -> None:
    """The verifier at level ``index`` must verify what the level below drafts, honour the sampling
    settings, and find what it and the drafter need in the level's model."""
    kind = drafter.draft_kind
    if kind not in verifier.accepts:
        fits = ", ".join(sorted(k.value for k in verifier.accepts))
        raise SpecstackError(f"verifier '{verifier.name}' at level {index} cannot verify {kind.value} drafts from '{drafter.name}'; it verifies: {fits}")
    verifier.check_sampling(sampling)
    needs = {
        f"drafter '{drafter.name}'": set(drafter.requires) | ({Capability.TREE_ATTENTION} if kind is not DraftKind.CHAIN else set()),
        f"verifier '{verifier.name}'": set(verifier.requires),
    }
    for who, required in needs.items():
        missing = required - set(level.model.capabilities)
        if missing:
            names = ", ".join(sorted(c.value for c in missing))
            raise SpecstackError(f"{who} at level {index} needs {names}, which the model of level {index} ({_name(level.model)}) does not provide")


def _name(model: CausalLM) -> str:
    return getattr(model, "name", type(model).__name__)


def _check_prompt(prompt: Sequence[int], target: CausalLM, max_new_tokens: int) -> list[int]:
    prompt = _token_ids(prompt)
    if not prompt:
        raise SpecstackError("the prompt is empty; give at least one token")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise SpecstackError(f"max_new_tokens {max_new_tokens!r} is not allowed; use an integer >= 1")
    bad = [t for t in prompt if not 0 <= t < target.vocab_size]
    if bad:
        raise SpecstackError(f"prompt token {bad[0]} is outside the vocabulary [0, {target.vocab_size})")
    check_window(target, len(prompt) + max_new_tokens, f"a {len(prompt)}-token prompt plus {max_new_tokens} new tokens")
    return prompt


def _token_ids(prompt: Sequence[int]) -> list[int]:
    """The prompt as ints: a sequence of integers, or a 1-D integer tensor or array; anything else (a batch, a
    float) is one error line, never a silent conversion."""
    if hasattr(prompt, "ndim") and hasattr(prompt, "tolist"):
        if prompt.ndim != 1:
            raise SpecstackError(f"the prompt has shape {list(prompt.shape)}; give one sequence of token ids (1-D)")
        prompt = prompt.tolist()
    ids = []
    for token in prompt:
        if not _is_integer(token):
            raise SpecstackError(f"prompt token {token!r} is not allowed; token ids are integers")
        ids.append(operator.index(token))
    return ids


def _is_integer(value: object) -> bool:
    """An int, a numpy integer or a 0-d integer tensor (what ``operator.index`` reads), not a bool."""
    return not isinstance(value, bool) and hasattr(type(value), "__index__")


def _check_seed(seed: int | None) -> None:
    if seed is not None and not _is_integer(seed):
        raise SpecstackError(f"seed {seed!r} is not allowed; use an integer, or None to continue the generators")


