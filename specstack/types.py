"""Value objects that travel between the parts of a stack.

Glossary (see docs/architecture.md):

* **level** – one model (or model-free drafter) with its own cache view. L0 drafts; Ln is the
  target whose distribution is preserved.
* **round** – one verification step of a level: ask the level below for up to γ tokens, score them
  in one forward pass, accept a prefix of them and emit one more token.
* **drafted** – tokens a level was offered by the level below in a round.
* **accepted** – the drafted tokens that passed verification.
* **recovered** – the token sampled from the residual distribution after the first rejection.
* **bonus** – the token sampled from the verifier's own distribution when every drafted token was
  accepted.
"""

from __future__ import annotations

import enum

import attrs
import torch


class Capability(str, enum.Enum):
    """Data a component may need from a model, declared up front and checked when a stack is built."""

    ATTENTION_WEIGHTS = "attention_weights"  # accumulated attention mass per cached slot (H2O)
    SPARSE_ATTENTION = "sparse_attention"  # a policy restricts each query to slots it picks (Top-K oracle)
    QUERIES = "queries"
    KEYS = "keys"
    HIDDEN_STATES = "hidden_states"
    TREE_ATTENTION = "tree_attention"


@attrs.frozen(kw_only=True, eq=False)
class Draft:
    """Tokens proposed by a drafter, with the distributions they were drawn from.

    ``tokens`` [k] are the proposed tokens and ``probs`` [k, V] the proposal distribution ``q`` at each
    of them (one-hot for deterministic drafters). ``parents`` [k] describes a token tree: the index of
    each token's parent inside the draft, -1 for children of the last committed token. ``None`` means
    a chain (``parents[i] == i - 1``); the built-in verifiers handle chains, tree verifiers read it.
    """

    tokens: torch.Tensor = attrs.field()  # [k]
    probs: torch.Tensor = attrs.field()  # [k, V]
    parents: torch.Tensor | None = None  # [k]

    @tokens.validator
    def _check(self, attribute, tokens: torch.Tensor) -> None:
        if tokens.dim() != 1 or self.probs.dim() != 2 or self.probs.shape[0] != tokens.shape[0]:
            raise ValueError(f"draft shapes disagree: tokens {tuple(tokens.shape)}, probs {tuple(self.probs.shape)}")

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    @classmethod
    def empty(cls, vocab_size: int) -> "Draft":
        return cls(tokens=torch.empty(0, dtype=torch.long), probs=torch.empty(0, vocab_size))

    def head(self, n: int) -> "Draft":
        """The first ``n`` tokens of a chain draft."""
        return Draft(tokens=self.tokens[:n], probs=self.probs[:n])


@attrs.frozen(kw_only=True)
class Verdict:
    """The outcome of verifying one draft.

    ``accepted`` are the indices of the accepted draft tokens, in order along the accepted path
    (``[0, 1, …, m-1]`` for a chain). ``next_token`` is the recovered token if a rejection happened,
    the bonus token otherwise; ``bonus`` tells which.
    """

    accepted: tuple[int, ...]
    next_token: int
    bonus: bool

    @property
    def num_accepted(self) -> int:
        return len(self.accepted)


@attrs.define(kw_only=True)
class LevelStats:
    """Running counters of one level, updated once per round."""

    name: str
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    rejected: int = 0  # rounds that ended in a rejection (the rest accepted their whole draft)
    emitted: int = 0
    forward_calls: int = 0
    forward_tokens: int = 0
    forward_seconds: float = 0.0
    gathers: int = 0

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted tokens (0 when nothing was drafted)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def token_acceptance_rate(self) -> float:
        """Accepted / examined tokens: a drafted token after the first rejection of its round is never
        examined. This estimates α, the probability that a draft token is accepted (Leviathan et al.,
        2023), which is what the TriForce paper reports as acceptance rate."""
        examined = self.accepted + self.rejected
        return self.accepted / examined if examined else 0.0

    @property
    def mean_accepted_per_round(self) -> float:
        return self.accepted / self.rounds if self.rounds else 0.0

    def as_dict(self) -> dict:
        return {
            **attrs.asdict(self),
            "acceptance_rate": self.acceptance_rate,
            "token_acceptance_rate": self.token_acceptance_rate,
            "mean_accepted_per_round": self.mean_accepted_per_round,
        }


@attrs.frozen(kw_only=True)
class GenerationResult:
    """What :meth:`SpeculationStack.generate` returns."""

    prompt_length: int
    tokens: tuple[int, ...]
    levels: tuple[LevelStats, ...]  # counters of the decoding phase, lowest level first
    seconds: float  # decoding, after the prompt was processed
    prefill_seconds: float
    stopped_by: str  # "eos" or "max_new_tokens"

    @property
    def tokens_per_second(self) -> float:
        return len(self.tokens) / self.seconds if self.seconds > 0 else float("inf")

    def as_dict(self) -> dict:
        return {
            "prompt_length": self.prompt_length,
            "tokens": list(self.tokens),
            "seconds": self.seconds,
            "prefill_seconds": self.prefill_seconds,
            "tokens_per_second": self.tokens_per_second,
            "stopped_by": self.stopped_by,
            "levels": [level.as_dict() for level in self.levels],
        }
