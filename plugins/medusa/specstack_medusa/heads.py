"""Medusa heads (Cai et al., 2024, Sec. 2.1.1): K small networks on the last hidden state h_t of the
model they draft for; head k turns h_t into a state whose logits, through that model's own LM head,
predict the token k + 1 positions ahead (x_{t+k+1}; the LM head itself predicts x_{t+1}).

Each head is ``layers`` residual blocks ``x + SiLU(W x + b)`` with W and b zero at initialisation,
so that an untrained head starts as the identity (it predicts what the LM head does). Heads with
``token_input`` also read the embedding e of x_{t+1}, the token after the state's position, in their
first block: ``x + SiLU(W [x; e] + b)``. When the heads draft, x_{t+1} is known: it is the token the
level above has just emitted from h_t (or, right after a prefill, its greedy choice), so nothing is
guessed; head k then no longer has to marginalise over x_{t+1} (the feature-plus-token input of EAGLE,
Li et al., 2024, here on Medusa's parallel heads).

``chained`` heads are one such head applied recurrently, as EAGLE's draft and ReDrafter (Cheng et al.,
2024) autoregress: s_1 = g(h_t, e(x_{t+1})) stands for h_{t+1} and predicts x_{t+2}; s_k = g(s_{k-1},
e(x_{t+k})) predicts x_{t+k+1}, where x_{t+k} is the token drafted from s_{k-1}. Step k then knows
every token before the one it predicts, where parallel head k must guess k - 1 of them; the price is
one pass of the LM head per depth, not one for all depths. ``heads`` is then the number of steps
trained and measured, and the file holds one head's weights. The LM head is
the target's, shared as in Medusa's later versions: the heads of a 576-wide model are 0.3M
parameters each. A file holds the heads' weights and, as safetensors metadata, a
:class:`HeadsInfo`: shapes, what they were trained for, and their measured top-k accuracy, from which
the drafter builds its tree of candidates (:mod:`specstack_medusa.tree`).
"""

from __future__ import annotations

import json
from pathlib import Path

import attrs
import torch

from specstack import SpecstackError
from specstack.packed_linear import pack_linears, read_bf16_numbers

ASSETS = Path(__file__).parent / "assets"
META = "specstack_medusa"  # the metadata key a heads file's HeadsInfo is stored under
TOKEN_RANK = "token_rank"  # the file's tensor of token ids by how often the target emitted them in the training data
SHIPPED = {"parallel": ASSETS / "smollm2-medusa" / "heads.safetensors",  # the heads shipped for the embedded default, by name
           "chained": ASSETS / "smollm2-medusa-chain" / "heads.safetensors"}


def _positive(instance, attribute, value, least: int = 1) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        raise SpecstackError(f"medusa heads {attribute.name} {value!r} is not allowed; use an integer >= {least}")


def _count(instance, attribute, value) -> None:
    _positive(instance, attribute, value, least=0)


@attrs.frozen(kw_only=True)
class HeadsInfo:
    """What a heads file says of itself. ``accuracy[k][r]``: how often head k + 1's rank-r candidate was
    the target's greedy token on held-out text (top-1 is r = 0; chained heads: step k + 1, given the true
    tokens before it)."""

    hidden_size: int = attrs.field(validator=_positive)
    heads: int = attrs.field(validator=_positive)
    layers: int = attrs.field(default=1, validator=_positive)
    vocab_size: int = attrs.field(validator=_positive)
    token_input: bool = False  # each head's first block also reads the embedding of the token after the state
    chained: bool = attrs.field(default=False)  # one head, applied once per step on its own output (needs token_input)
    draft_vocab: int = attrs.field(default=0, validator=_count)  # the drafter's default: draft from this many of the ranked tokens (0: all)
    target: str = ""
    accuracy: tuple[tuple[float, ...], ...] = attrs.field(default=(), converter=lambda rows: tuple(tuple(float(a) for a in r) for r in rows))

    @chained.validator
    def _chain_reads_tokens(self, attribute, value) -> None:
        if value and not self.token_input:
            raise SpecstackError("chained medusa heads read the token after each state; set token_input too")

    def to_json(self) -> str:
        return json.dumps(attrs.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "HeadsInfo":
        return cls(**json.loads(text))


class ResBlock(torch.nn.Module):
    """x + SiLU(W x + b) ([n, H] -> [n, H]), W and b zero at first: the identity. With ``reads_token``,
    x + SiLU(W [x; e] + b), e [n, H] the embedding of the token after x's position."""

    def __init__(self, hidden_size: int, reads_token: bool = False) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(hidden_size * (2 if reads_token else 1), hidden_size)
        torch.nn.init.zeros_(self.linear.weight)
        torch.nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor, after: torch.Tensor | None = None) -> torch.Tensor:
        inputs = x if after is None else torch.cat([x, after.to(x.dtype)], dim=-1)  # [n, H] or [n, 2H]
        return x + torch.nn.functional.silu(self.linear(inputs))  # [n, H]


class MedusaHeads(torch.nn.Module):
    """K heads of ``layers`` residual blocks each: [n, H] last hidden states -> [K, n, H] head states
    (chained: one head, K steps). ``info`` says what they are and what they were measured to do."""

    def __init__(self, info: HeadsInfo) -> None:
        super().__init__()
        self.info = info
        self.token_rank: torch.Tensor | None = None  # [V] token ids, most often emitted by the target first (draft_vocab reads it)
        self.blocks = torch.nn.ModuleList(torch.nn.ModuleList(ResBlock(info.hidden_size, reads_token=info.token_input and i == 0) for i in range(info.layers))
                                          for _ in range(1 if info.chained else info.heads))

    @classmethod
    def random(cls, info: HeadsInfo, scale: float = 0.3, seed: int = 0) -> "MedusaHeads":
        """Heads with random weights (tests, the conformance suite): they draft badly, never wrongly."""
        return randomized(cls(info), scale, seed)

    def forward(self, states: torch.Tensor, after: torch.Tensor | None = None) -> torch.Tensor:
        """[n, H] states (and, for heads with token input, [n, H] the embeddings of the tokens after
        them; chained heads: [K, n, H], the embeddings of x_{t+1} … x_{t+K}) -> [K, n, H] head states."""
        if self.info.token_input and after is None:
            raise SpecstackError("these medusa heads read the embedding of the token after each state; pass it")
        if self.info.chained:
            steps = []
            for k in range(self.info.heads):
                states = self.step(states, after[k])  # [n, H]: s_{k+1} from s_k (s_0 = h_t) and e(x_{t+k+1})
                steps.append(states)
            return torch.stack(steps)  # [K, n, H]
        return torch.stack([self._head(blocks, states, after) for blocks in self.blocks])  # [K, n, H]

    def step(self, states: torch.Tensor, after: torch.Tensor) -> torch.Tensor:
        """Chained heads' one step: [n, H] states s_k and [n, H] embeddings of the tokens after them -> [n, H] s_{k+1}."""
        return self._head(self.blocks[0], states, after)  # [n, H]

    @staticmethod
    def _head(blocks: torch.nn.ModuleList, x: torch.Tensor, after: torch.Tensor | None) -> torch.Tensor:
        x = blocks[0](x, after)  # [n, H]: only the first block reads the token
        for block in blocks[1:]:
            x = block(x)  # [n, H]
        return x


def randomized(module: torch.nn.Module, scale: float, seed: int) -> torch.nn.Module:
    """``module`` with every weight drawn from N(0, scale²), seeded: a draft that drafts badly, never wrongly."""
    generator = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.copy_(scale * torch.randn(parameter.shape, generator=generator, device="cpu"))
    return module


def stream_on_cpu(heads: MedusaHeads) -> int:
    """Let the fp32 heads' linears on the CPU take the project's few-row kernel (:mod:`specstack.packed_linear`),
    their weights rounded to bf16 numbers and read as bf16: half the bytes, fp32 arithmetic. A draft's step reads
    its 5 MB of weights from memory after each target forward, where this took 0.38-0.49 ms a step against
    0.76-0.81 through ``F.linear`` (chained heads, 7,500-token bf16 target, docs/medusa.md). Only the draft
    changes (by the weights' rounding), never the verified output. The heads are drafting's from then on: no
    gradients. Returns how many linears read bf16."""
    linears = [m for m in heads.modules() if type(m) is torch.nn.Linear and m.weight.device.type == "cpu" and m.weight.dtype == torch.float32]
    heads.requires_grad_(False)  # drafting only: every call takes the kernel, with or without autograd
    with torch.no_grad():
        for linear in linears:
            linear.weight.copy_(linear.weight.to(torch.bfloat16).float())
    pack_linears(heads)
    return read_bf16_numbers(heads)


def save_heads(path: str | Path, heads: MedusaHeads) -> None:
    write_weights(path, heads, META, heads.info.to_json())


def write_weights(path: str | Path, module: torch.nn.Module, meta_key: str, meta: str, dtype: torch.dtype | None = None) -> None:
    """Write ``module``'s weights (in ``dtype``, else their own) and its ``token_rank`` to a safetensors file, with
    ``meta`` (what it says of itself) under ``meta_key``."""
    from safetensors.torch import save_file

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.detach().to(dtype or t.dtype).contiguous().cpu() for name, t in module.state_dict().items()}
    if module.token_rank is not None:
        tensors[TOKEN_RANK] = module.token_rank.to(torch.int32).cpu()
    save_file(tensors, str(path), metadata={meta_key: meta})


def read_weights(path: Path, meta_key: str, kind: str, build) -> torch.nn.Module:
    """The module ``build(meta)`` makes from the metadata under ``meta_key``, with the file's weights and ``token_rank``;
    one error line (naming the file as not ``kind`` file, e.g. "a medusa heads") if it is not such a file."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as file:
            meta = (file.metadata() or {}).get(meta_key)
            tensors = {name: file.get_tensor(name) for name in file.keys()}
        if meta is None:
            raise ValueError(f"no {meta_key} metadata")
        module = build(meta)
        rank = tensors.pop(TOKEN_RANK, None)
        module.load_state_dict(tensors)
    except SpecstackError:
        raise
    except Exception as error:  # a corrupt or foreign file: one line, not a traceback
        raise SpecstackError(f"{str(path)!r} is not {kind} file: {str(error).splitlines()[0][:200]}") from None
    module.token_rank = None if rank is None else rank.long()  # [V]
    return module


def stored_file(path: str | Path, shipped: dict[str, Path], what: str, advice: str) -> Path:
    """``path``, or the shipped file it names (``shipped``); one error line ("``what`` file ... does not exist;
    ``advice``") where that is no file."""
    path = shipped.get(str(path), Path(path))
    if not path.is_file():
        raise SpecstackError(f"{what} file {str(path)!r} does not exist; {advice}")
    return path


def load_heads(path: str | Path, dtype: torch.dtype = torch.float32) -> MedusaHeads:
    """The heads in ``path``, a file or the name of shipped heads (``SHIPPED``); one error line if it is
    not a heads file."""
    path = stored_file(path, SHIPPED, "medusa heads", f"name shipped heads ({', '.join(SHIPPED)}) or train a file with `specstack train medusa`")
    return read_weights(path, META, "a medusa heads", lambda meta: MedusaHeads(HeadsInfo.from_json(meta))).to(dtype).eval()


def synthetic_heads(vocab: int, token_input: bool = False, chained: bool = False) -> MedusaHeads:
    """Random heads for the synthetic models of :mod:`specstack.synthetic` (hidden size 8): what the
    conformance suite runs the medusa drafter and stacks with."""
    return MedusaHeads.random(HeadsInfo(hidden_size=8, heads=3, vocab_size=vocab, token_input=token_input or chained, chained=chained))


def shipped_heads(name: str = "parallel") -> Path:
    """The heads trained for the embedded default (SmolLM2-135M-Instruct) under ``name``; see their TRAINING.md."""
    return SHIPPED[name]
