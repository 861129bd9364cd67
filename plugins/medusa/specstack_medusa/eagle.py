"""EAGLE's draft layer (Li et al., 2024, "EAGLE: Speculative Sampling Requires Rethinking Feature
Uncertainty", Sec. 3.1-3.2): one decoder layer that autoregresses over the target's features.

The chained Medusa head (:mod:`specstack_medusa.heads`) turns one state and one token into the next state,
s_{t+1} = g(s_t, e(x_{t+1})), and knows nothing else of the text. EAGLE's draft reads the same pair at every
position t, as a row

    u_t = W_fc [f_t; e(x_{t+1})]                                            (EAGLE, Eq. in Sec. 3.2)

and lets one Llama decoder layer (pre-norm attention and SwiGLU MLP, rotary positions) attend over the rows of
the last ``window`` positions: its output at row t stands for f_{t+1}, the target's last hidden state (after its
final norm) at t + 1, and through the target's own LM head predicts x_{t+2}. Drafting, the rows of committed
positions hold the target's true features (:class:`FeatureCache`), and each drafted token adds a row whose
feature is the layer's own prediction, attending over the committed rows and its own ancestors in the tree.

A file holds the layer's weights and, as safetensors metadata, an :class:`EagleInfo` with the fields the
Medusa drafter reads of heads (``heads``: the steps trained and measured; ``accuracy``: each step's rank
accuracy), so that :class:`~specstack_medusa.eagle_drafter.EagleDrafter` drafts its trees as the chained
heads' drafter does.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import attrs
import numpy as np
import torch

from specstack import SpecstackError

from .heads import randomized, read_weights, stored_file, write_weights

ASSETS = Path(__file__).parent / "assets"
SHIPPED = {"eagle": ASSETS / "smollm2-eagle" / "layer.safetensors"}  # the layer shipped for the embedded default, by name
META = "specstack_eagle"


def _positive(instance, attribute, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise SpecstackError(f"eagle layer {attribute.name} {value!r} is not allowed; use an integer >= 1")


@attrs.frozen(kw_only=True)
class EagleInfo:
    """What a layer file says of itself. ``heads`` is the number of steps trained and measured (the name the
    Medusa drafter reads); ``accuracy[k][r]``: how often step k + 1's rank-r candidate was the target's greedy
    token on held-out text, given the true tokens before it."""

    hidden_size: int = attrs.field(validator=_positive)
    attention_heads: int = attrs.field(validator=_positive)
    intermediate_size: int = attrs.field(validator=_positive)
    heads: int = attrs.field(validator=_positive)
    window: int = attrs.field(default=128, validator=_positive)  # committed rows a drafted row attends over
    rope_theta: float = 10000.0
    vocab_size: int = attrs.field(validator=_positive)
    draft_vocab: int = 0
    target: str = ""
    accuracy: tuple[tuple[float, ...], ...] = attrs.field(default=(), converter=lambda rows: tuple(tuple(float(a) for a in r) for r in rows))

    chained = True  # what the Medusa drafter asks of heads: one step after another,
    token_input = True  # each reading the token after its state

    @attention_heads.validator
    def _divides(self, attribute, value) -> None:
        if self.hidden_size % value or (self.hidden_size // value) % 2:
            raise SpecstackError(f"eagle layer attention_heads {value!r} is not allowed; use a divisor of {self.hidden_size} leaving an even head size")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.attention_heads

    def to_json(self) -> str:
        return json.dumps(attrs.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "EagleInfo":
        return cls(**json.loads(text))


def rotate(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary position embedding (Su et al., 2021; Llama's rotate-half form) of ``x`` [..., n, A, D] at
    ``positions`` [..., n], computed in float32."""
    dim = x.shape[-1]
    inverse = theta ** (-torch.arange(0, dim, 2, dtype=torch.float32, device=x.device) / dim)  # [D/2]
    angles = positions.to(torch.float32)[..., None] * inverse  # [..., n, D/2]
    angles = torch.cat([angles, angles], -1)[..., None, :]  # [..., n, 1, D]
    wide = x.float()
    first, second = wide.chunk(2, dim=-1)
    return (wide * angles.cos() + torch.cat([-second, first], -1) * angles.sin()).to(x.dtype)  # [..., n, A, D]


def attend(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """[n, A, D] queries over [m, A, D] keys and values, each query over the keys ``allowed`` [n, m] marks
    -> [n, A, D]."""
    scores = torch.einsum("nad,mad->anm", queries, keys) / math.sqrt(queries.shape[-1])  # [A, n, m]
    weights = torch.softmax(scores.float().masked_fill(~allowed, float("-inf")), dim=-1).to(values.dtype)  # [A, n, m]
    return torch.einsum("anm,mad->nad", weights, values)  # [n, A, D]


class EagleLayer(torch.nn.Module):
    """The draft: ``fc`` on [feature; token embedding], then one pre-norm decoder layer. Split in two around its
    attention, which the caller does over whatever rows a row may see (:meth:`rows`, then :meth:`finish`)."""

    def __init__(self, info: EagleInfo) -> None:
        super().__init__()
        size = info.hidden_size
        self.info = info
        self.token_rank: torch.Tensor | None = None  # [V] token ids, most often emitted by the target first (draft_vocab reads it)
        self.fc = torch.nn.Linear(2 * size, size, bias=False)
        self.attention_norm = torch.nn.RMSNorm(size, eps=1e-5)
        self.qkv = torch.nn.Linear(size, 3 * size, bias=False)
        self.out = torch.nn.Linear(size, size, bias=False)
        self.mlp_norm = torch.nn.RMSNorm(size, eps=1e-5)
        self.gate_up = torch.nn.Linear(size, 2 * info.intermediate_size, bias=False)
        self.down = torch.nn.Linear(info.intermediate_size, size, bias=False)

    @classmethod
    def random(cls, info: EagleInfo, scale: float = 0.1, seed: int = 0) -> "EagleLayer":
        """A layer with random weights (tests, the conformance suite): it drafts badly, never wrongly."""
        return randomized(cls(info), scale, seed)

    def rows(self, features: torch.Tensor, embedded: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """[..., n, H] features f_t and [..., n, H] embeddings of x_{t+1} at ``positions`` [..., n] -> the rows
        u [..., n, H] and their queries, keys and values [..., n, A, D], rotated to their positions."""
        u = self.fc(torch.cat([features, embedded.to(features.dtype)], dim=-1))  # [..., n, H]
        heads = self.info.attention_heads
        q, k, v = self.qkv(self.attention_norm(u)).unflatten(-1, (3, heads, self.info.head_dim)).unbind(-3)  # [..., n, A, D] each
        return u, rotate(q, positions, self.info.rope_theta), rotate(k, positions, self.info.rope_theta), v

    def finish(self, u: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """Rows u [..., n, H] and what their queries attended to [..., n, A, D] -> [..., n, H] predicted features."""
        x = u + self.out(attended.flatten(-2))  # [..., n, H]
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)  # [..., n, I] each
        return x + self.down(torch.nn.functional.silu(gate) * up)  # [..., n, H]


@attrs.define(eq=False)
class FeatureCache:
    """The keys and values of the draft layer's committed rows, and the token x_{t+1} each row read, for the last
    ``window`` positions, in static buffers of twice that: appending is O(rows), and once full the last ``window``
    move to the front (one copy every ``window`` rows). ``next`` is the first position not held; ``truncate`` is
    O(1)."""

    window: int
    _keys: torch.Tensor | None = attrs.field(init=False, default=None)  # [2W, A, D]
    _values: torch.Tensor | None = attrs.field(init=False, default=None)  # [2W, A, D]
    _tokens: np.ndarray = attrs.field(init=False)  # [2W] the token after each row's position
    _length: int = attrs.field(init=False, default=0)  # rows held
    next: int = attrs.field(init=False, default=0)  # the position after the last row held

    def __attrs_post_init__(self) -> None:
        self._tokens = np.zeros(2 * self.window, dtype=np.int64)

    @property
    def first(self) -> int:
        """The position of the first row held."""
        return self.next - self._length

    def clear(self, position: int = 0) -> None:
        """Hold nothing; the next row appended is at ``position``."""
        self._length, self.next = 0, position

    def truncate(self, position: int) -> None:
        """Forget the rows at ``position`` and after (before the first row held: all of them, and the next row
        appended is at ``position``)."""
        if position <= self.first:
            self.clear(position)
        elif position < self.next:
            self._length, self.next = self._length - (self.next - position), position

    def agreeing(self, tokens: np.ndarray) -> int:
        """How many leading rows read the ``tokens`` [n] after their positions (``tokens[i]`` follows position
        ``first + i``): the rows after them read another text."""
        n = min(self._length, tokens.shape[0])
        differ = np.flatnonzero(self._tokens[:n] != tokens[:n])
        return int(differ[0]) if differ.size else n

    def append(self, keys: torch.Tensor, values: torch.Tensor, tokens: np.ndarray) -> None:
        """Rows [n, A, D] at positions ``next`` … ``next + n - 1``, which read ``tokens`` [n]."""
        n = keys.shape[0]
        if n > self.window:
            self.clear(self.next + n - self.window)
            keys, values, tokens, n = keys[-self.window :], values[-self.window :], tokens[-self.window :], self.window
        if self._keys is None or self._keys.shape[1:] != keys.shape[1:] or self._keys.dtype != keys.dtype or self._keys.device != keys.device:
            self._keys = keys.new_empty(2 * self.window, *keys.shape[1:])  # [2W, A, D]
            self._values = values.new_empty(2 * self.window, *values.shape[1:])
            self.clear(self.next)
        if self._length + n > 2 * self.window:
            keep = min(self._length, self.window - n)
            for buffer in (self._keys, self._values):
                buffer[:keep] = buffer[self._length - keep : self._length].clone()
            self._tokens[:keep] = self._tokens[self._length - keep : self._length].copy()
            self._length = keep
        self._keys[self._length : self._length + n] = keys
        self._values[self._length : self._length + n] = values
        self._tokens[self._length : self._length + n] = tokens
        self._length += n
        self.next += n

    def view(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values [w, A, D] of the last ``window`` rows held (w <= window)."""
        if self._keys is None:
            return torch.empty(0), torch.empty(0)
        first = max(0, self._length - self.window)
        return self._keys[first : self._length], self._values[first : self._length]


def save_layer(path: str | Path, layer: EagleLayer) -> None:
    """Write ``layer`` to ``path``, its weights rounded to bf16: half the bytes, and on the CPU the drafter reads its
    weights as bf16 numbers anyway (:func:`~specstack_medusa.heads.stream_on_cpu`)."""
    write_weights(path, layer, META, layer.info.to_json(), torch.bfloat16)


def load_layer(path: str | Path, dtype: torch.dtype = torch.float32) -> EagleLayer:
    """The layer in ``path``, a file or the name of a shipped layer (``SHIPPED``); one error line if it is not
    an EAGLE layer file."""
    path = stored_file(path, SHIPPED, "eagle layer", f"name a shipped layer ({', '.join(SHIPPED)}) or train a file with `specstack train eagle`")
    return read_weights(path, META, "an eagle layer", lambda meta: EagleLayer(EagleInfo.from_json(meta))).to(dtype).eval()


def synthetic_layer(vocab: int) -> EagleLayer:
    """A random layer for the synthetic models of :mod:`specstack.synthetic` (hidden size 8)."""
    return EagleLayer.random(EagleInfo(hidden_size=8, attention_heads=2, intermediate_size=16, heads=3, window=16, vocab_size=vocab))
