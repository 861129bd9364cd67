"""transformers-backed models implementing the :class:`~specstack.model.CausalLM` protocol.

The model's own modeling code runs unchanged. specstack plugs in through transformers' two
extension points: the cache object (a :class:`~specstack.kvstore.KVStore` receives each layer's new
keys and values and returns the level's view) and the attention function (registered under the name
``"specstack"``), which attends over the view without expanding grouped-query keys.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from pathlib import Path
from typing import Iterator

import attrs
import torch
import torch.nn.functional as F

from .attention import attention_weights
from .errors import SpecstackError
from .batch import TokenBatch
from .kvstore import KVStore
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
    if batch is None:  # new tokens at the end of the keys, each seeing the keys up to its own
        causal = torch.ones(t, n, dtype=torch.bool, device=query.device).tril(diagonal=n - t)  # [T, n]
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=causal, scale=scaling, enable_gqa=True)
        return out.transpose(1, 2), None
    if batch.queries is not None:
        batch.queries.record(module.layer_idx, module.config.num_hidden_layers, query[0, :, batch.query_row])
    if batch.record_attention or batch.attend is not None:
        return _explicit_attention(module, query, key, value, batch, kwargs["specstack_store"], scaling), None
    if t == n and batch.is_chain:  # a prefill with nothing cached: plain causal attention
        out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling, enable_gqa=True)  # [1, Hq, T, D]
        return out.transpose(1, 2), None
    group = hq // hkv
    q = query.reshape(1, hkv, group * t, d)  # [1, Hkv, G*T, D]
    mask = batch.mask(n - t, group, query.device) if t > 1 else None  # [G*T, n]
    out = F.scaled_dot_product_attention(q, key, value, attn_mask=mask, scale=scaling)  # [1, Hkv, G*T, D]
    return out.reshape(1, hq, t, d).transpose(1, 2), None  # [1, T, Hq, D]


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

    def __init__(self, store: KVStore) -> None:
        self.store = store

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """key/value [1, H, T, D] of one layer -> the layer's view [1, H, n+T, D]."""
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
        {Capability.KEYS, Capability.QUERIES, Capability.ATTENTION_WEIGHTS, Capability.SPARSE_ATTENTION, Capability.TREE_ATTENTION})
    vocab_size: int = attrs.field(init=False)
    max_length: int = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        config = self.module.config
        if config.model_type not in SUPPORTED_ARCHITECTURES:
            raise SpecstackError(f"model architecture {config.model_type!r} is not supported by the KV store; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        _register_attention()
        self.module.set_attn_implementation(ATTENTION_NAME)
        self.module.eval()
        self.vocab_size = config.vocab_size
        self.max_length = config.max_position_embeddings

    @property
    def dtype(self) -> torch.dtype:
        return next(self.module.parameters()).dtype

    @property
    def device(self) -> torch.device:
        return next(self.module.parameters()).device

    def new_cache(self, capacity: int, *, relative_positions: bool = False) -> KVStore:
        config = self.module.config
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return KVStore(
            layers=config.num_hidden_layers, kv_heads=config.num_key_value_heads, head_dim=head_dim,
            capacity=capacity, dtype=self.dtype, device=self.device,
            relative_positions=relative_positions, rerotate=self._rerotate,
        )

    @torch.inference_mode()
    def forward(self, batch: TokenBatch, cache: KVStore) -> torch.Tensor:
        cache.begin(batch.positions)
        out = self.module(
            input_ids=batch.tokens[None].to(self.device),  # [1, T]
            position_ids=cache.rope_positions(batch.positions)[None].to(self.device),  # [1, T]
            past_key_values=StoreCache(cache),
            use_cache=True,
            logits_to_keep=max(batch.num_logits, 1),
            specstack_batch=batch,
            specstack_store=cache,
        )
        cache.commit()
        return out.logits[0, out.logits.shape[1] - batch.num_logits :].float()  # [num_logits, V]

    @torch.inference_mode()
    def _rerotate(self, keys: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """Rotate keys [L, H, n, D] by ``delta`` [n] more positions (RoPE angles add up)."""
        cos, sin = self.module.model.rotary_emb(keys, position_ids=delta[None].to(keys.device))  # [1, n, D]
        half = keys.shape[-1] // 2
        rotated = torch.cat([-keys[..., half:], keys[..., :half]], dim=-1)  # rotate_half
        return keys * cos[0].to(keys.dtype) + rotated * sin[0].to(keys.dtype)


def tokenizer_fingerprint(tokenizer) -> str:
    """Identifies a tokenizer by its vocabulary: two levels of a stack must have the same one."""
    vocab = json.dumps(sorted(tokenizer.get_vocab().items()), separators=(",", ":"))
    return hashlib.sha1(vocab.encode()).hexdigest()[:16]


def load_model(path: str | Path, *, dtype: torch.dtype = torch.float32, device: str = "cpu", name: str | None = None):
    """Load ``(model, tokenizer)`` from a transformers directory, a ``.gguf`` file or a hub id."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path)
    kwargs = {"gguf_file": path.name} if path.suffix == ".gguf" else {}
    source = str(path.parent if kwargs else path)
    if (kwargs or path.is_absolute() or str(path).startswith(".")) and not path.exists():
        raise SpecstackError(f"model file {str(path)!r} does not exist; give a transformers directory or a .gguf file")
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, **kwargs)
        module = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, **kwargs).to(device)
    except (OSError, ValueError, KeyError, RuntimeError) as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise SpecstackError(f"cannot load model {str(path)!r}: {first[:300]}") from None
    model = HFCausalLM(module=module, tokenizer_id=tokenizer_fingerprint(tokenizer), name=name or path.name)
    return model, tokenizer
