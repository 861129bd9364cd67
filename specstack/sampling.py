"""Turning logits into the distribution a level samples from.

Losslessness needs every level to apply *the same* warp (temperature, top-k, top-p) to its own
logits: the target's distribution is ``warp(target_logits)``, and each lower level's proposal is
``warp(its_logits)``. :func:`warp` is that single shared function.

Temperature 0 is greedy decoding: the warp is a one-hot vector on the argmax (the first one on
ties), so no division by zero happens and speculative sampling reduces to "accept iff the argmax
agrees".

Coupled sampling (``coupled=True``, above temperature 0) draws the token at position t as
``argmax_x p_t(x) / E_t(x)``, where the E_t(x) are independent Exp(1) numbers fixed by the seed and t alone
(:func:`position_noise`): the exponential race, which is the Gumbel-max trick (argmax of log p + Gumbel) in
another form, so each token is a sample from p_t. The warp is then the one-hot vector on that token and every
level decodes "greedily" over it: a stack's output is a function of the seed and the target alone, the very text
plain autoregressive sampling with that seed writes, whatever the drafts (drafter-invariant speculative
decoding: Daliri, Musco and Suresh, 2024). A draft token is accepted iff the target's race picks it, so a
drafter that runs its own race on the same noise is accepted where the two races agree. :func:`warp` runs the race
in its Gumbel form, the argmax of log p_t(x) + G_t(x) with G = -log E in float32 (:class:`RaceNoise` keeps a level's
rows by position, so that a position warped again costs an add and an argmax, not a new draw).
"""

from __future__ import annotations

import math

import attrs
import numpy as np
import torch

from .errors import SpecstackError

PREFILTER_FIRST = 64  # top-p first looks at this many of the highest logits, doubling while their mass falls short
PREFILTER_MARGIN = 1e-6  # how far past top_p their mass must reach: well above the rounding of a float32 cumsum


def _temperature(instance, attribute, value: float) -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
        raise SpecstackError(f"temperature {value!r} is not allowed; use a finite number >= 0 (0 means greedy)")


def _top_p(instance, attribute, value: float) -> None:
    if not (isinstance(value, (int, float)) and 0 < value <= 1):
        raise SpecstackError(f"top_p {value!r} is not allowed; use a number in (0, 1]")


def _coupled(instance, attribute, value: bool) -> None:
    if not isinstance(value, bool):
        raise SpecstackError(f"coupled {value!r} is not allowed; use True or False")


def _top_k(instance, attribute, value: int | None) -> None:
    if value is not None and not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
        raise SpecstackError(f"top_k {value!r} is not allowed; use an integer >= 1, or None for no limit")


@attrs.frozen(kw_only=True)
class SamplingConfig:
    """How tokens are drawn, identically at every level of a stack."""

    temperature: float = attrs.field(default=0.0, validator=_temperature)
    top_p: float = attrs.field(default=1.0, validator=_top_p)
    top_k: int | None = attrs.field(default=None, validator=_top_k)
    coupled: bool = attrs.field(default=False, validator=_coupled)  # each position's draw fixed by the seed (module docstring)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def deterministic(self) -> bool:
        """Whether the warp is one-hot (greedy, or coupled above temperature 0): a level's token is then a function of
        its logits, the seed and the position, and the greedy verifier is the lossless one."""
        return self.greedy or self.coupled

    @property
    def marginal(self) -> "SamplingConfig":
        """The distribution each token is drawn from: these settings without the coupling (coupled draws are samples
        of it)."""
        return attrs.evolve(self, coupled=False)


def warp(logits: torch.Tensor, config: SamplingConfig, *, seed: int | None = None, positions: torch.Tensor | None = None,
         noise: RaceNoise | None = None) -> torch.Tensor:
    """Return the sampling distribution for each row of ``logits`` ([..., V] -> [..., V], float32). Coupled sampling
    needs the ``seed`` and each row's ``positions`` [...] in the sequence: its warp is one-hot on that row's draw (the
    race's noise read from ``noise``, a level's rows kept by position, where given; else made afresh)."""
    logits = logits.float()  # [..., V]
    if config.greedy:
        return _one_hot_argmax(logits)
    if config.coupled:
        if seed is None or positions is None:
            raise SpecstackError("coupled sampling draws each position's token from the seed and the position; pass seed= and positions=")
        gumbel = (noise if noise is not None else RaceNoise()).gumbel(seed, positions, logits.shape[-1], logits.device)  # [..., V]
        return one_hot(first_argmax(_race_scores(logits, config) + gumbel), logits.shape[-1])  # [..., V]
    logits = _scaled(logits, config)  # [..., V]
    probs = logits.softmax(dim=-1)  # [..., V]
    if config.top_p < 1:
        probs = _nucleus(probs, logits, config.top_p)
    return probs


def _scaled(logits: torch.Tensor, config: SamplingConfig) -> torch.Tensor:
    """float32 logits [..., V] over the temperature, those below the top-k's k-th at -inf ([..., V])."""
    logits = logits / config.temperature  # [..., V]
    if config.top_k is not None and config.top_k < logits.shape[-1]:
        kth = logits.topk(config.top_k, dim=-1).values[..., -1:]  # [..., 1]
        logits = logits.masked_fill(logits < kth, -math.inf)  # ties with the k-th are kept
    return logits


def _race_scores(logits: torch.Tensor, config: SamplingConfig) -> torch.Tensor:
    """log p(x) up to a constant per row, for p the marginal warp ([..., V] float32; -inf where p is 0): the race's
    draw is the argmax of these plus the position's Gumbel numbers. Without top-p these are the scaled logits
    themselves (the softmax's log-normaliser changes no argmax), so no softmax is taken."""
    if config.top_p < 1:
        return warp(logits, config.marginal).log()  # [..., V]
    return _scaled(logits, config)  # [..., V]


def _one_hot_argmax(logits: torch.Tensor) -> torch.Tensor:
    return one_hot(first_argmax(logits), logits.shape[-1])  # [..., V]


def one_hot(tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Token ids [...] -> [..., V] float32 rows, 1 at each token and 0 elsewhere, on the tokens' device: the greedy warp's
    distribution where ``tokens`` are the argmaxes."""
    rows = torch.zeros(*tokens.shape, vocab_size, device=tokens.device)  # [..., V]
    return rows.scatter_(-1, tokens[..., None], 1.0)


def first_argmax(x: torch.Tensor, *, keepdim: bool = False) -> torch.Tensor:
    """The index of each row's largest value, the first one on ties and NaN counting as largest: ``torch.argmax``'s
    rule ([..., V] -> [...] int64, or [..., 1] with ``keepdim``). On the CPU numpy's vectorised argmax computes it,
    about 15x faster than torch's reduction over a vocabulary-wide row (docs/benchmarks.md, "A step's sampling in place")."""
    if x.device.type != "cpu" or x.dtype != torch.float32 or x.requires_grad:
        return x.argmax(dim=-1, keepdim=keepdim)
    return torch.from_numpy(np.asarray(np.argmax(x.numpy(), axis=-1, keepdims=keepdim)))  # [...] or [..., 1]


def _nucleus(probs: torch.Tensor, logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest most-likely set whose mass reaches ``top_p``; renormalise. Tokens are ranked
    by their logits: two whose probabilities round to the same float keep their order, so the most
    likely token is never the one dropped."""
    # the prefilter relies on the CPU's sequential cumsum; a GPU scan may round a prefix differently (and sorts fast)
    drop = _drop_within_top(probs, logits, top_p) if logits.device.type == "cpu" else None  # [..., V]
    if drop is None:
        drop = _drop_by_sort(probs, logits, top_p)
    probs = probs.masked_fill(drop, 0.0)
    return probs / probs.sum(dim=-1, keepdim=True)


def _drop_by_sort(probs: torch.Tensor, logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """The tokens top-p drops, from a stable sort of the whole vocabulary by logit ([..., V] bool)."""
    order = logits.sort(dim=-1, descending=True, stable=True).indices  # [..., V]
    sorted_probs = probs.gather(-1, order)  # [..., V]
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # [..., V]
    drop_sorted = mass_before >= top_p  # [..., V]; the first token is never dropped
    return torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)  # [..., V]


def _drop_within_top(probs: torch.Tensor, logits: torch.Tensor, top_p: float) -> torch.Tensor | None:
    """What :func:`_drop_by_sort` returns, found among the k highest logits (k = 64 first, then as
    many as the nucleus needs at least, up to a quarter of the vocabulary), or None when it may reach
    further (then sort everything)."""
    k, most = PREFILTER_FIRST, logits.shape[-1] // 4
    while k <= most:
        drop, needed = _drop_among(probs, logits, top_p, k)
        if drop is not None:
            return drop
        if not needed <= most:  # also NaN or inf: sort everything
            return None
        k = max(2 * k, 1 << math.ceil(math.log2(max(needed, 1.0))))
    return None


def _drop_among(probs: torch.Tensor, logits: torch.Tensor, top_p: float, k: int) -> tuple[torch.Tensor | None, float]:
    """The tokens strictly above the k-th highest logit are exactly the first m of the full ranking;
    ranked by value and then index, they get the full ranking's cumulative mass (on the CPU a cumsum
    is a sequential scan, so a prefix of it is the scan of the prefix), hence its drop decisions.
    Every token after them is dropped by the full ranking too once their mass exceeds ``top_p`` by
    more than rounding can take back. Otherwise: (None, how many tokens the nucleus needs at least)."""
    index = logits.topk(k, dim=-1, sorted=False).indices.sort(dim=-1).values  # [..., k] ascending
    values = logits.gather(-1, index)  # [..., k]
    rank = values.sort(dim=-1, descending=True, stable=True).indices  # [..., k]; ties stay in index order
    index, values = index.gather(-1, rank), values.gather(-1, rank)  # [..., k] as the full ranking has them
    certain = values > values[..., -1:]  # [..., k]; a tie at the k-th value may continue outside the top k
    sorted_probs = probs.gather(-1, index)  # [..., k]
    mass = sorted_probs.cumsum(dim=-1)  # [..., k]
    reached = mass.masked_fill(~certain, 0.0).amax(dim=-1)  # [...]; the mass of the first m
    short = top_p + PREFILTER_MARGIN - reached  # [...]
    if bool((short > 0).any()):  # each further token holds at most the k-th probability
        needed = torch.where(short > 0, certain.sum(dim=-1) + short / sorted_probs[..., -1], 0.0)  # [...]
        return None, float(needed.max())
    keep_sorted = certain & (mass - sorted_probs < top_p)  # [..., k]
    return torch.ones_like(probs, dtype=torch.bool).scatter_(-1, index, ~keep_sorted), 0.0  # [..., V]


def position_noise(seed: int, positions: torch.Tensor, vocab_size: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """E [..., V] float64: independent Exp(1) numbers, row i a function of ``seed`` and ``positions[i]`` alone
    (:func:`exponentials`), so that every level of a stack, and plain decoding, races on the same numbers at the
    same position. Made once per distinct position (a tree's siblings share theirs)."""
    distinct, index = torch.unique(positions.reshape(-1).cpu(), return_inverse=True)  # [u], [n]
    rows = [exponentials(seed, position, vocab_size) for position in distinct.tolist()]
    noise = torch.from_numpy(np.stack(rows)) if rows else torch.empty(0, vocab_size, dtype=torch.float64, device="cpu")  # [u, V]
    return noise[index].reshape(*positions.shape, vocab_size).to(device)  # [..., V]


def exponentials(seed: int, position: int, vocab_size: int) -> np.ndarray:
    """[V] float64 independent Exp(1) numbers: numpy's PCG64 seeded with the pair (``seed``, ``position``). About
    0.2 ms for SmolLM2's 49,152 on the 2-core host."""
    return np.random.Generator(np.random.PCG64([seed, position])).standard_exponential(vocab_size)


@attrs.define(eq=False)
class RaceNoise:
    """One level's race noise as Gumbel numbers G = -log E [V] (float32) by position, each position's row made once
    for its seed (:func:`exponentials`, about 0.25 ms a row of 49,152 with the log) and then read by every warp of it: a verify
    warps again the positions its last rejection left, and a coupled round's rows cost a read and an add instead of
    a fresh race (docs/benchmarks.md, "Coupled draws from kept noise"). Keeps the ``capacity`` latest positions."""

    capacity: int = 64
    _key: tuple[int, int] | None = attrs.field(default=None, init=False)  # (seed, vocabulary) the rows are for
    _rows: dict[int, torch.Tensor] = attrs.field(factory=dict, init=False)  # position -> [V] float32 on the CPU

    def gumbel(self, seed: int, positions: torch.Tensor, vocab_size: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """[..., V] float32: the Gumbel numbers of each of ``positions`` [...] for ``seed``."""
        if self._key != (seed, vocab_size):
            self._key, self._rows = (seed, vocab_size), {}
        wanted = positions.reshape(-1).tolist()
        for position in set(wanted) - self._rows.keys():
            self._rows[position] = torch.from_numpy(-np.log(exponentials(seed, position, vocab_size).astype(np.float32)))  # [V]
        rows = torch.stack([self._rows[p] for p in wanted]) if wanted else torch.empty(0, vocab_size, device="cpu")  # [n, V]
        if len(self._rows) > self.capacity:
            for old in sorted(self._rows)[: len(self._rows) - self.capacity]:
                del self._rows[old]
        return rows.reshape(*positions.shape, vocab_size).to(device)  # [..., V]


def race_arrivals(probs: torch.Tensor, seed: int, positions: torch.Tensor, count: int) -> torch.Tensor:
    """[..., V] distributions at ``positions`` [...] -> [..., count] the first ``count`` arrivals of each row's race on
    the noise of its position (largest p / E first; at most as many as the row's support is wide, so ``count`` must not
    exceed it): the first is the coupled draw, the others the draws without replacement that would follow it."""
    scores = probs.double() / position_noise(seed, positions, probs.shape[-1], probs.device)  # [..., V]
    return scores.topk(count, dim=-1).indices  # [..., count]


def draw_without_replacement(q: torch.Tensor, count: int, generator: torch.Generator) -> torch.Tensor:
    """[count] tokens drawn from q [V] one after another without replacement: the first arrivals of the exponential
    race, arrival time -log(u) / q(x) for u uniform (the Gumbel top-k of Kool et al., 2019), on q's device. Past q's
    support the rest are tokens of q = 0 in no particular order; a caller wanting draws only asks for at most as many."""
    u = torch.rand(q.shape[0], generator=generator, device=q.device)  # [V]
    return (u.log() / q).topk(count).indices  # [count]: the largest log(u) / q arrive first


def sample(probs: torch.Tensor, generator: torch.Generator) -> int:
    """Draw one token from a single distribution ``probs`` [V] (non-negative, any positive finite total) with an
    explicit generator (:func:`draw`, after checking that it is a distribution)."""
    total, lowest = torch.stack([probs.sum(), probs.min()]).tolist()  # one host synchronisation
    if not (math.isfinite(total) and total > 0) or lowest < 0:
        raise ValueError(f"cannot sample from a distribution with total mass {total} (entries must be >= 0, the total positive and finite)")
    return int(draw(probs, generator))


def draw(probs: torch.Tensor, generator: torch.Generator, count: int = 1) -> torch.Tensor:
    """[V] non-negative weights -> [count] tokens drawn independently (with replacement), each with probability
    proportional to its weight, on their device without a host synchronisation: the first token whose cumulative
    weight exceeds u times the total, u uniform in [0, 1) (inverse-CDF sampling). A token of weight zero adds
    nothing to the cumulative weight, so it is never drawn; where u times the total rounds up to the total, u is
    taken just below it. One uniform per token and one scan: ``torch.multinomial`` drew one exponential per token
    of the vocabulary: 1.24 ms a token for SmolLM2's 49,152 on the 2-core AVX2 host, this 93 µs
    (docs/benchmarks.md, "Sampling and gathering")."""
    cumulative = probs.float().cumsum(0)  # [V]
    total = cumulative[-1:]  # [1]
    u = torch.rand(count, generator=generator, device=probs.device, dtype=torch.float32) * total  # [count]
    u = torch.minimum(u, torch.nextafter(total, torch.zeros_like(total)))  # [count], below the total
    return torch.searchsorted(cumulative, u, right=True)  # [count]
