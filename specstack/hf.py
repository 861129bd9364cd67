"""transformers-backed models implementing the :class:`~specstack.model.CausalLM` protocol.

The model's own modeling code runs unchanged. specstack plugs in through transformers' two
extension points: the cache object (a :class:`~specstack.kvstore.KVStore` receives each layer's new
keys and values and returns the level's view) and the attention function (registered under the name
``"specstack"``), which attends over the view without expanding grouped-query keys.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import attrs
import torch
import torch.nn.functional as F

from .attention import attention_weights
from .errors import SpecstackError
from .kvstore import KVStore, causal_mask
from .types import Capability

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2")
ATTENTION_NAME = "specstack"


def grouped_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Attention over a KV view, GQA-aware: query [1, Hq, T, D], key/value [1, Hkv, n, D].

    The Hq/Hkv query heads that share a KV head are folded into the query length, so the keys are
    read once per KV head instead of being repeated. New tokens are the last T of the n keys, and
    each attends to every cached slot and to the new tokens up to itself.
    """
    store: KVStore | None = kwargs.get("specstack_store")  # None when transformers drives the model (generate)
    if store is not None and store.records_queries:
        store.record_query(module.layer_idx, query[0, :, -1])
    _, hq, t, d = query.shape
    hkv, n = key.shape[1], key.shape[2]
    if store is not None and (store.records_attention or store.attention_filter is not None):
        return _explicit_attention(module, query, key, value, store, scaling), None
    if t == n:  # a prefill with nothing cached: plain causal attention
        out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling, enable_gqa=True)  # [1, Hq, T, D]
        return out.transpose(1, 2), None
    group = hq // hkv
    q = query.reshape(1, hkv, group * t, d)  # [1, Hkv, G*T, D]
    mask = None
    if t > 1:
        mask = store.causal_mask(group) if store is not None else causal_mask(t, n, group, query.device)  # [G*T, n]
    out = F.scaled_dot_product_attention(q, key, value, attn_mask=mask, scale=scaling)  # [1, Hkv, G*T, D]
    return out.reshape(1, hq, t, d).transpose(1, 2), None  # [1, T, Hq, D]


def _explicit_attention(module, query, key, value, store: KVStore, scaling) -> torch.Tensor:
    """The same attention with its weights computed explicitly, for policies that read or restrict
    them (H2O, the Top-K oracle): query [1, Hq, T, D] -> [1, T, Hq, D]."""
    _, hq, t, d = query.shape
    hkv = key.shape[1]
    group = hq // hkv
    q = query[0].reshape(hkv, group * t, d)  # [Hkv, G*T, D]
    scale = scaling if scaling is not None else d**-0.5
    weights = attention_weights(q, key[0], store.causal_mask(group), scale, group, store.attention_filter)  # [Hkv, G*T, n]
    if store.records_attention:
        store.accumulate_attention(module.layer_idx, weights.sum(1))  # [Hkv, n]
    out = weights.to(value.dtype) @ value[0]  # [Hkv, G*T, D]
    return out.reshape(1, hq, t, d).transpose(1, 2)  # [1, T, Hq, D]


def _register_attention() -> None:
    from transformers import AttentionInterface

    # No mask function is registered for this name, so transformers builds no mask: grouped_attention
    # builds its own from the query and key lengths.
    AttentionInterface.register(ATTENTION_NAME, grouped_attention)


@attrs.define(eq=False, kw_only=True)
class HFCausalLM:
    """A transformers causal LM as a stack level's model."""

    module: torch.nn.Module
    tokenizer_id: str | None
    name: str = "model"
    capabilities: frozenset[Capability] = frozenset(
        {Capability.KEYS, Capability.QUERIES, Capability.ATTENTION_WEIGHTS, Capability.SPARSE_ATTENTION})
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
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVStore, num_logits: int) -> torch.Tensor:
        cache.begin(positions)
        out = self.module(
            input_ids=tokens[None].to(self.device),  # [1, T]
            position_ids=cache.rope_positions(positions)[None].to(self.device),  # [1, T]
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=max(num_logits, 1),
            specstack_store=cache,
        )
        cache.commit()
        return out.logits[0, out.logits.shape[1] - num_logits :].float()  # [num_logits, V]

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
