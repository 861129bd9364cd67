"""transformers-backed models implementing the :class:`~specstack.model.CausalLM` protocol.

The model's own modeling code runs unchanged. specstack plugs in through transformers' two
extension points: the cache object (a :class:`~specstack.kvstore.KVStore` receives each layer's new
keys and values and returns the level's view) and the attention function (registered under the name
``"specstack"``), which attends over the view without expanding grouped-query keys. On the CPU, a
Llama-family model's forwards take :mod:`specstack.decoder` instead, which computes the same layers
with the same modules, cache object and attention function in fewer calls.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
from pathlib import Path
from typing import Iterator

import attrs
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from .attention import attention_weights
from .errors import SpecstackError
from .batch import TokenBatch
from .decode_attention import DecodeKernel, load_decode_kernel
from .gather_ops import GatherOps, load_gather_ops
from .decoder import LeanDecoder
from .decoder_ops import rotate_half
from .graphs import ForwardGraphs, StaticView
from .kvstore import KVStore
from .gguf_weights import attach_gguf_blocks
from .packed_linear import PackedLinear, pack_linears, read_bf16_numbers
from .weight_formats import blocks_of, grouped
from .types import Capability

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2")
ATTENTION_NAME = "specstack"


def grouped_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Attention over a KV view, GQA-aware: query [1, Hq, T, D], key/value [1, Hkv, n, D].

    The Hq/Hkv query heads that share a KV head are folded into the query length, so the keys are
    read once per KV head instead of being repeated. New tokens are the last T of the n keys; each
    attends to every cached slot and to the new tokens its batch's ``sees`` allows (a chain or a tree).
    """
    batch: TokenBatch | None = kwargs.get("specstack_batch")  # None when transformers drives the model (generate)
    _, hq, t, d = query.shape
    hkv, n = key.shape[1], key.shape[2]
    view: StaticView | None = kwargs.get("specstack_view")
    if view is not None:  # a graphed forward: the whole store under a mask computed on the device
        return _folded_attention(query, key, value, view.visible, scaling), None
    if batch is None:  # new tokens at the end of the keys, each seeing the keys up to its own
        causal = torch.ones(t, n, dtype=torch.bool, device=query.device).tril(diagonal=n - t)  # [T, n]
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=causal, scale=scaling, enable_gqa=True)
        return out.transpose(1, 2), None
    if batch.queries is not None:
        batch.queries.record(module.layer_idx, module.config.num_hidden_layers, query[0, :, batch.query_row])
    if batch.record_attention or batch.attend is not None:
        return _explicit_attention(module, query, key, value, batch, kwargs["specstack_store"], scaling), None
    if batch.is_chain and (t == n or query.is_cuda):
        # a prefill with nothing cached, or a chain on a GPU: causal attention aligned to the last key
        # (bottom right), which SDPA runs in its flash kernel, grouped-query heads included
        causal = causal_lower_right(t, n) if 1 < t < n else None  # t == n: plain is_causal, fast on the CPU too
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=causal, is_causal=1 < t == n, scale=scaling, enable_gqa=hq != hkv)  # [1, Hq, T, D]
        return out.transpose(1, 2), None
    sees = None if batch.is_chain else batch.sees  # [T, T] among the new tokens; None: causal
    kernel: DecodeKernel | None = kwargs.get("specstack_attention_kernel")
    if kernel is not None and kernel.applies(query, key, value):  # a few tokens over a float32 or bfloat16 cache on the CPU
        return kernel.attend(query, key, value, scaling, sees, kwargs.get("specstack_store"), module.layer_idx), None
    if 1 < t < n and _CPU_FLASH is not None and not query.is_cuda:  # verifies, trees, prefill chunks
        return _split_attention(query, key, value, scaling, sees), None
    # one token (or no CPU flash kernel): folding the GQA group into the query length reads each key
    # once, faster than SDPA's grouped path on the CPU
    mask = batch.mask(n - t, hq // hkv, query.device) if t > 1 else None  # [G*T, n]
    return _folded_attention(query, key, value, mask, scaling), None


def _folded_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, scaling) -> torch.Tensor:
    """SDPA with the query heads of each KV group folded into the query length: query [1, Hq, T, D],
    key/value [1, Hkv, n, D], mask [G*T, n] (row j*T + t: head j of the group, token t) -> [1, T, Hq, D]."""
    _, hq, t, d = query.shape
    hkv = key.shape[1]
    q = query.reshape(1, hkv, hq // hkv * t, d)  # [1, Hkv, G*T, D]
    out = F.scaled_dot_product_attention(q, key, value, attn_mask=mask, scale=scaling)  # [1, Hkv, G*T, D]
    return out.reshape(1, hq, t, d).transpose(1, 2)  # [1, T, Hq, D]


# The CPU's flash kernel, which also returns each row's log-sum-exp (None where torch lacks it).
_CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _split_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling, sees: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of T new tokens over n keys, the last T their own, with no [T, n] mask: query
    [1, Hq, T, D], key/value [1, Hkv, n, D], ``sees`` [T, T] among the new tokens (None: causal, a
    chain) -> [1, T, Hq, D].

    Every new token sees every cached key, so that part is unmasked flash attention with the query
    heads of each KV group folded into the query length (each key read once); the new tokens' own
    keys take a T x T mask (a chain's is top-left causal, a tree's its ancestry). The two partial
    softmaxes are merged by their log-sum-exps, as flash-decoding merges its splits (Dao et al.,
    2023): out = Σ_i e^{lse_i - m} o_i / Σ_i e^{lse_i - m}. Measured on the CPU (one thread, 8K-16K
    keys) against the masked folded kernel: 0.85x the time at 16-256 tokens, 0.5x at 2,048, level
    below 16; a chunked prefill costs what one causal prefill does, in O(T·D) memory.
    """
    _, hq, t, d = query.shape
    hkv, n = key.shape[1], key.shape[2]
    group = hq // hkv
    past, past_lse = _CPU_FLASH(query.reshape(1, hkv, group * t, d), key[:, :, : n - t], value[:, :, : n - t], scale=scaling)  # [1, Hkv, G*T, D], [1, Hkv, G*T]
    own_keys = key[:, :, n - t :].repeat_interleave(group, 1)  # [1, Hq, T, D]
    own_values = value[:, :, n - t :].repeat_interleave(group, 1)  # [1, Hq, T, D]
    if sees is None:
        own, own_lse = _CPU_FLASH(query, own_keys, own_values, is_causal=True, scale=scaling)  # [1, Hq, T, D], [1, Hq, T]
    else:
        bias = torch.zeros(t, t, dtype=query.dtype, device=query.device).masked_fill(~sees.to(query.device), float("-inf"))  # [T, T]
        own, own_lse = _CPU_FLASH(query, own_keys, own_values, attn_mask=bias, scale=scaling)  # [1, Hq, T, D], [1, Hq, T]
    past_lse = past_lse.reshape(1, hq, t)  # [1, Hq, T]
    top = torch.maximum(past_lse, own_lse)  # [1, Hq, T]
    w_past, w_own = (past_lse - top).exp()[..., None], (own_lse - top).exp()[..., None]  # [1, Hq, T, 1] each
    out = (past.reshape(1, hq, t, d).float() * w_past + own.float() * w_own) / (w_past + w_own)  # [1, Hq, T, D]
    return out.to(query.dtype).transpose(1, 2)  # [1, T, Hq, D]


def _explicit_attention(module, query, key, value, batch: TokenBatch, store: KVStore, scaling) -> torch.Tensor:
    """The same attention with its weights computed explicitly, for policies that read or restrict
    them (H2O, the Top-K oracle): query [1, Hq, T, D] -> [1, T, Hq, D]."""
    _, hq, t, d = query.shape
    hkv, n = key.shape[1], key.shape[2]
    group = hq // hkv
    q = query[0].reshape(hkv, group * t, d)  # [Hkv, G*T, D]
    scale = scaling if scaling is not None else d**-0.5
    weights = attention_weights(q, key[0], batch.mask(n - t, group, query.device), scale, group, batch.attend)  # [Hkv, G*T, n]
    if batch.record_attention:
        store.accumulate_attention(module.layer_idx, weights.sum(1))  # [Hkv, n]
    out = weights.to(value.dtype) @ value[0]  # [Hkv, G*T, D]
    return out.reshape(1, hq, t, d).transpose(1, 2)  # [1, T, Hq, D]


class StoreCache:
    """The transformers ``Cache`` surface over a :class:`KVStore`, for one forward pass: the model's
    attention layers hand it their new keys and values and get the level's view back."""

    def __init__(self, store: KVStore, view: StaticView | None = None) -> None:
        self.store = store
        self.view = view  # a graphed forward: write at the view's device-side slots, read the whole store

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """key/value [1, H, T, D] of one layer -> the layer's view [1, H, n+T, D] (the whole store [1, H, C, D]
        in a graphed forward)."""
        if self.view is not None:
            keys, values = self.store.write_at(layer_idx, self.view.slots, key[0], value[0])
        else:
            keys, values = self.store.write(layer_idx, key[0], value[0])
        return keys[None], values[None]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.store.length


def _register_attention() -> None:
    from transformers import AttentionInterface

    # No mask function is registered for this name, so transformers builds no mask: grouped_attention
    # builds its own from the query and key lengths.
    AttentionInterface.register(ATTENTION_NAME, grouped_attention)


@contextlib.contextmanager
def transformers_attention(modules: list[torch.nn.Module], name: str) -> Iterator[None]:
    """Run transformers modules with one of transformers' own attention implementations (``"sdpa"``,
    ``"eager"``), e.g. for ``generate``, and restore specstack's afterwards."""
    before = [m.config._attn_implementation for m in modules]
    try:
        for module in modules:
            module.set_attn_implementation(name)
    except (ValueError, ImportError) as error:
        for module, old in zip(modules, before):
            module.set_attn_implementation(old)
        raise SpecstackError(f"attn_implementation {name!r} is not available: {str(error).splitlines()[0][:200]}") from None
    try:
        yield
    finally:
        for module, old in zip(modules, before):
            module.set_attn_implementation(old)


@attrs.define(eq=False, kw_only=True)
class HFCausalLM:
    """A transformers causal LM as a stack level's model."""

    module: torch.nn.Module
    tokenizer_id: str | None
    name: str = "model"
    capabilities: frozenset[Capability] = frozenset(
        {Capability.KEYS, Capability.QUERIES, Capability.ATTENTION_WEIGHTS, Capability.SPARSE_ATTENTION, Capability.TREE_ATTENTION,
         Capability.HIDDEN_STATES})
    cuda_graphs: bool = True  # replay short chain forwards over bounded stores as CUDA graphs (specstack.graphs)
    packed_linears: bool = True  # the module's linear layers on the CPU: a few rows streamed (fp32, and bf16 with AVX-512 bf16), more through oneDNN over packed weights (fp32, and bf16 where oneDNN has bf16 kernels) (specstack.packed_linear)
    decode_kernel: bool = True  # attention of a few new tokens over a float32 or bfloat16 cache on the CPU (specstack.decode_attention)
    lean_decoder: bool = True  # CPU forwards without transformers' per-layer Python, q/k/v and gate/up fused (specstack.decoder)
    vocab_size: int = attrs.field(init=False)
    max_length: int = attrs.field(init=False)
    graphs: ForwardGraphs = attrs.field(init=False)
    attention_kernel: DecodeKernel | None = attrs.field(init=False)  # None: not asked for, or no compiler here
    gather_ops: GatherOps = attrs.field(init=False)  # its stores' copy of chosen entries: a retrieval view's, a per-head eviction's (specstack.gather_ops)
    decoder: LeanDecoder | None = attrs.field(init=False)  # None: not asked for, or a decoder it does not fit
    token_rank: torch.Tensor | None = attrs.field(init=False, default=None)  # [V] a draft's token ids, most frequent first (draft_vocabulary)
    vocabulary: tuple | None = attrs.field(init=False, default=None)  # (rows [R], their head [n, H] -> [n, R]): logits of those tokens only

    def __attrs_post_init__(self) -> None:
        config = self.module.config
        if config.model_type not in SUPPORTED_ARCHITECTURES:
            raise SpecstackError(f"model architecture {config.model_type!r} is not supported by the KV store; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        _register_attention()
        self.module.set_attn_implementation(ATTENTION_NAME)
        self.module.eval()
        if self.packed_linears:
            pack_linears(self.module)
        self.vocab_size = config.vocab_size
        self.max_length = config.max_position_embeddings
        self.attention_kernel = load_decode_kernel() if self.decode_kernel else None
        self.gather_ops = load_gather_ops()
        self.decoder = LeanDecoder.build(self.module) if self.lean_decoder else None
        self.graphs = ForwardGraphs(self._static_forward, config.num_attention_heads // config.num_key_value_heads)

    def weights_held(self) -> contextlib.AbstractContextManager:
        """A scope over which the weights stay as they are (``SpeculationStack.generate`` opens one for its run): the
        lean decoder then checks them at its first forward only (:meth:`LeanDecoder.weights_held`)."""
        return self.decoder.weights_held() if self.decoder is not None else contextlib.nullcontext()

    def widen_bf16_products(self) -> None:
        """Take every bf16 product of this model's forwards widened to float32: its attention kernel without AMX tiles
        or bf16 dot products, and its linear layers' rows (up to sixteen) streamed and widened. Each token of a verify
        of up to sixteen tokens then gets the one-token step's logits bit for bit, as on a CPU where widening is what
        pays, so its bf16 stacks write autoregressive decoding's very output (docs/exactness.md). Where tiles or dot
        products pay, wide verifies cost more (docs/benchmarks.md, "bf16 verifies widened on request"). float32
        forwards are unchanged."""
        if self.attention_kernel is not None:
            self.attention_kernel = attrs.evolve(self.attention_kernel, amx=False, dot_products=False)
        linears = [m for m in self.module.modules() if isinstance(m, PackedLinear)]
        linears += [product.linear for product in self.decoder.products()] if self.decoder is not None else []
        for linear in linears:
            if linear._rows is not None:
                linear._rows = attrs.evolve(linear._rows, tiles=False, bf16_dots=False)  # new kernels: the compiled layers plan again

    def read_weights_from(self, gguf: str | Path) -> int:
        """Let products of a few rows read the blocks of the GGUF at ``gguf`` (Q4_1 layer matrices; a Q8_0
        embedding for a tied LM head) instead of the weights those blocks widen to, bit for bit
        (:mod:`specstack.gguf_weights`): the same outputs from fewer bytes. Returns how many matrices took
        them (none where the weights differ)."""
        taken = attach_gguf_blocks(self.module, gguf)
        if taken and self.decoder is not None:
            self.decoder.attach_part_blocks()  # the fused products take their parts' blocks
        return taken

    def read_head_blocks_of(self, other: "HFCausalLM") -> bool:
        """Let this model's LM head read the stored blocks ``other``'s LM head reads, where they widen to this head's
        weight bit for bit: a bf16 draft whose head is the target's embedding rounded to bf16 reads the GGUF's Q8_0
        embedding, as the target's head does. Returns whether it does."""
        mine, theirs = self.module.get_output_embeddings(), other.module.get_output_embeddings()
        return (isinstance(mine, PackedLinear) and isinstance(theirs, PackedLinear) and theirs._blocks is not None
                and mine.attach_exact_blocks(theirs._blocks, theirs._format))

    def read_bf16_numbers(self) -> int:
        """Let products of a few fp32 rows read as bf16 the weights that are bf16 numbers (a draft's embedding
        frozen in bf16 and the LM head tied to it): the same outputs from half the bytes. Returns how many
        matrices do."""
        taken = read_bf16_numbers(self.module)
        if taken and self.decoder is not None:
            self.decoder.attach_part_blocks()  # the fused products take their parts' rows
        return taken

    def linear_bytes_per_weight(self, rows: int) -> float:
        """Bytes a forward of ``rows`` tokens reads per weight of the decoder layers' linear maps (the
        floor's weight term, :func:`specstack.floor.forward_floor`)."""
        linears = [m for m in self.module.model.layers.modules() if isinstance(m, torch.nn.Linear)]
        each = [m.bytes_per_weight(rows) if isinstance(m, PackedLinear) else m.weight.element_size() for m in linears]
        return sum(b * m.weight.numel() for b, m in zip(each, linears)) / sum(m.weight.numel() for m in linears)

    def head_bytes_per_weight(self, rows: int) -> float:
        """Bytes a forward computing ``rows`` rows of logits reads per weight of the LM head (the floor's head term)."""
        head = self.module.get_output_embeddings()
        return head.bytes_per_weight(rows) if isinstance(head, PackedLinear) else head.weight.element_size()

    @property
    def dtype(self) -> torch.dtype:
        return next(self.module.parameters()).dtype

    @property
    def device(self) -> torch.device:
        return next(self.module.parameters()).device

    @property
    def hidden_size(self) -> int:
        return int(self.module.config.hidden_size)

    @torch.inference_mode()
    def output_logits(self, states: torch.Tensor) -> torch.Tensor:
        """[n, H] last hidden states -> [n, V] float32 logits: the model's own LM head."""
        return self.module.lm_head(states.to(self.dtype)).float()  # [n, V]

    @torch.inference_mode()
    def output_head(self, rows: torch.Tensor):
        """The LM head's rows ``rows`` [R] (token ids) as a function [n, H] -> [n, R] float32 logits: a copy of
        those rows of its weight (R x H), computed as the LM head is (the few-row kernel where it has one, reading those rows
        of its narrower stored blocks where it reads them)."""
        head = self.module.lm_head
        part = torch.nn.Linear(head.in_features, rows.numel(), bias=head.bias is not None, device=head.weight.device, dtype=head.weight.dtype)
        part.weight.copy_(head.weight[rows.to(head.weight.device)])  # [R, H]
        if head.bias is not None:
            part.bias.copy_(head.bias[rows.to(head.weight.device)])  # [R]
        part.requires_grad_(False)
        if isinstance(head, PackedLinear):
            PackedLinear.adopt(part, head._rows)
            if head._blocks is not None:  # the head's rows stored narrower (the GGUF's Q8_0): read those rows' blocks too
                part.attach_exact_blocks(grouped(blocks_of(head._blocks, head._format.block_bytes)[rows.to(head._blocks.device)]), head._format)
        return lambda states: part(states.to(part.weight.dtype)).float()  # [n, H] -> [n, R]

    def with_vocabulary(self, rows: torch.Tensor) -> "HFCausalLM":
        """This model with logits for the tokens ``rows`` [R] only and -inf for the others (a draft vocabulary,
        :mod:`specstack.draft_vocabulary`): the same module, kernels and caches, those rows' logits computed through a
        copy of them of its LM head (:meth:`output_head`): the whole head's columns, bit for bit in bf16, in fp32 up to
        the order a product with fewer outputs may sum in (test_medusa's output_head test)."""
        other = copy.copy(self)
        rows = rows.to(self.device)
        other.vocabulary = (rows, self.output_head(rows))
        other.graphs = ForwardGraphs(other._static_forward, self.graphs.group)
        return other

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, H] last hidden states -> [n, V] float32 logits: the LM head, or its vocabulary's rows and -inf elsewhere."""
        if self.vocabulary is None:
            return self.module.lm_head(hidden).float()  # [n, V]
        rows, head = self.vocabulary
        logits = torch.full((hidden.shape[0], self.vocab_size), float("-inf"), device=hidden.device)  # [n, V]
        logits[:, rows] = head(hidden)  # [n, R]
        return logits

    @torch.inference_mode()
    def input_embeddings(self, tokens: torch.Tensor) -> torch.Tensor:
        """[n] token ids -> [n, H]: the model's own input embedding, in its dtype."""
        return self.module.get_input_embeddings()(tokens.to(self.device))  # [n, H]

    def new_cache(self, capacity: int, *, relative_positions: bool = False) -> KVStore:
        config = self.module.config
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return KVStore(
            layers=config.num_hidden_layers, kv_heads=config.num_key_value_heads, head_dim=head_dim,
            capacity=capacity, dtype=self.dtype, device=self.device,
            relative_positions=relative_positions, rerotate=self._rerotate, gather_ops=self.gather_ops,
        )

    @torch.inference_mode()
    def forward(self, batch: TokenBatch, cache: KVStore) -> torch.Tensor:
        cache.begin(batch.positions)
        rope = cache.rope_positions(batch.positions)  # [T]
        if self.cuda_graphs and ForwardGraphs.applies(batch, cache):
            logits = self.graphs.forward(batch, cache, rope)  # [num_logits, V]
        else:
            tokens, rope = batch.tokens[None].to(self.device), rope[None].to(self.device)  # [1, T] each
            logits, hidden = self._run(tokens, rope, StoreCache(cache), batch.num_logits, batch.hidden_rows, specstack_batch=batch,
                                      specstack_store=cache, specstack_attention_kernel=self.attention_kernel)
            batch.hidden = hidden if batch.keep_hidden else None
        cache.commit()
        return logits

    def _static_forward(self, store: KVStore, tokens: torch.Tensor, rope: torch.Tensor, view: StaticView, num_logits: int) -> torch.Tensor:
        """The forward a CUDA graph captures: static device inputs, the store seen through ``view``."""
        return self._run(tokens, rope, StoreCache(store, view), num_logits, specstack_view=view, specstack_store=store)[0]

    def _run(self, tokens: torch.Tensor, rope: torch.Tensor, cache: StoreCache, num_logits: int, hidden_rows: int = 0,
             **attention) -> tuple[torch.Tensor, torch.Tensor]:
        """The module over tokens and rotary positions [1, T] -> the logits [num_logits, V] of the last
        ``num_logits`` tokens and the last hidden states [n, H] of the last n = max(num_logits, ``hidden_rows``), as
        the model's own forward computes them (its decoder, then its LM head over the logits' rows only): on the CPU
        through the lean decoder where there is one, else through the module."""
        if self.decoder is not None and self.decoder.applies(tokens):
            states = self.decoder.run(tokens, rope, cache, grouped_attention, **attention)  # [1, T, H]
        else:
            states = self.module.model(input_ids=tokens, position_ids=rope, past_key_values=cache, use_cache=True, **attention).last_hidden_state  # [1, T, H]
        rows = min(max(num_logits, hidden_rows), states.shape[1])
        hidden = states[0, states.shape[1] - rows :]  # [n, H]
        return self._logits(hidden[rows - num_logits :]), hidden  # [num_logits, V], [n, H]

    @torch.inference_mode()
    def _rerotate(self, keys: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """Rotate keys [L, H, n, D] by ``delta`` [n] more positions (RoPE angles add up), in float32,
        rounded once to the keys' dtype. The angles are the model's own (its rotary embedding, any
        scaling of the frequencies included); its attention scaling, already in the keys, is not
        applied twice."""
        rotary = self.module.model.rotary_emb
        exact = keys.float()  # [L, H, n, D]
        cos, sin = rotary(exact, position_ids=delta[None].to(keys.device))  # [1, n, D] each, float32
        scale = getattr(rotary, "attention_scaling", 1.0)
        return ((exact * cos[0] + rotate_half(exact) * sin[0]) / scale).to(keys.dtype)  # [L, H, n, D]


def tokenizer_fingerprint(tokenizer) -> str:
    """Identifies a tokenizer by its vocabulary: two levels of a stack must have the same one."""
    vocab = json.dumps(sorted(tokenizer.get_vocab().items()), separators=(",", ":"))
    return hashlib.sha1(vocab.encode()).hexdigest()[:16]


ROPE_SCALINGS = ("yarn", "linear")  # transformers' rope types that stretch a window by a factor
NO_SCALING = "none"  # as the command line says None: a window beyond the trained one is refused
EXTRAPOLATE = "extrapolate"  # beyond the trained window with RoPE unchanged: to measure what scaling buys


def load_model(path: str | Path, *, dtype: torch.dtype = torch.float32, device: str = "cpu", name: str | None = None,
               context: int | None = None, rope_scaling: str | None = None):
    """Load ``(model, tokenizer)`` from a transformers directory, a ``.gguf`` file or a hub id.

    ``context``: the window to run the model with (default: its trained one). A window beyond the
    trained one needs ``rope_scaling`` (``"yarn"`` or ``"linear"``), applied through transformers' own
    ``rope_parameters`` with factor context / trained window; a shorter one only bounds the caches.
    ``"none"`` (as None) refuses a window beyond the trained one. ``"extrapolate"`` opens the window
    with RoPE unchanged: the model is then outside what it was trained on (docs/long-context.md
    measures how far outside), for measurements only.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path)
    kwargs = {"gguf_file": path.name} if path.suffix == ".gguf" else {}
    source = str(path.parent if kwargs else path)
    if (kwargs or path.is_absolute() or str(path).startswith(".")) and not path.exists():
        raise SpecstackError(f"model file {str(path)!r} does not exist; give a transformers directory or a .gguf file")
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, **kwargs)
        config = window_config(source, kwargs, context, rope_scaling)
        module = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, config=config, **kwargs).to(device)
    except SpecstackError:  # a bad window: already one line of its own
        raise
    except (OSError, ValueError, KeyError, RuntimeError) as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise SpecstackError(f"cannot load model {str(path)!r}: {first[:300]}") from None
    model = HFCausalLM(module=module, tokenizer_id=tokenizer_fingerprint(tokenizer), name=name or path.name)
    return model, tokenizer


def window_config(source: str, kwargs: dict, context: int | None, rope_scaling: str | None):
    """The model's config, its window set to ``context`` (RoPE-scaled beyond the trained window)."""
    from transformers import AutoConfig

    rope_scaling = None if rope_scaling == NO_SCALING else rope_scaling
    if rope_scaling is not None and rope_scaling not in (*ROPE_SCALINGS, EXTRAPOLATE):
        raise SpecstackError(f"rope scaling {rope_scaling!r} is not allowed; use {', '.join(ROPE_SCALINGS)} or {EXTRAPOLATE} (or none)")
    if context is not None and (not isinstance(context, int) or isinstance(context, bool) or context < 1):
        raise SpecstackError(f"context {context!r} is not allowed; use a number of tokens >= 1")
    config = AutoConfig.from_pretrained(source, **kwargs)
    trained = config.max_position_embeddings
    if context is None or context <= trained:
        config.max_position_embeddings = context or trained  # a shorter window: smaller caches, same model
        return config
    if rope_scaling is None:
        raise SpecstackError(f"context {context} is beyond the model's trained window of {trained} tokens; "
                             f"allowed beyond it only with a RoPE scaling method: {' or '.join(ROPE_SCALINGS)}")
    config.max_position_embeddings = context
    if rope_scaling == EXTRAPOLATE:
        return config
    rope = dict(config.rope_parameters or {})
    if rope.get("rope_type", "default") != "default":
        raise SpecstackError(f"the model already uses RoPE scaling {rope['rope_type']!r}; context {context} would stack "
                             f"{rope_scaling!r} on top of it; use a context of at most {trained}")
    rope.update(rope_type=rope_scaling, factor=context / trained, original_max_position_embeddings=trained)
    config.rope_parameters = rope
    return config
