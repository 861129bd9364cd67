"""Random-weight Llama models for tests that need a real transformer but no downloaded weights.

Losslessness holds for any weights, so a randomly initialised model checks every mechanism a real
one does (the KV store, rotary positions, grouped-query attention, the attention kernels, CUDA
graphs) and travels anywhere: a lent GPU has no model hub. ``logit_scale`` sharpens the output
distribution, as trained models have, so that greedy comparisons are not decided by near-ties.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from ..hf import HFCausalLM

TOKENIZER_ID = "random-llama"  # levels of one stack must share a tokenizer id


def random_llama(*, seed: int = 0, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, vocab_size: int = 256,
                 hidden_size: int = 64, intermediate_size: int = 128, layers: int = 2, heads: int = 4, kv_heads: int = 2,
                 max_positions: int = 2048, logit_scale: float = 8.0, name: str = "random-llama", **options) -> HFCausalLM:
    """A ``LlamaForCausalLM`` with seeded random weights, wrapped as a stack level's model (``options``:
    :class:`HFCausalLM`'s switches, e.g. ``lean_decoder=False``)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         max_position_embeddings=max_positions, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    with torch.random.fork_rng(devices=[]):  # leave the caller's global random state alone
        torch.manual_seed(seed)
        module = LlamaForCausalLM(config)
    with torch.no_grad():
        module.lm_head.weight.mul_(logit_scale)
    return HFCausalLM(module=module.to(device=device, dtype=dtype), tokenizer_id=TOKENIZER_ID, name=name, **options)


def perturbed(model: HFCausalLM, *, noise: float, seed: int, device: torch.device | str | None = None, name: str = "perturbed") -> HFCausalLM:
    """A copy of ``model`` whose every weight has Gaussian noise of ``noise`` times its own standard
    deviation added: a draft that agrees with the target often, but not always."""
    module = copy.deepcopy(model.module)
    generator = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        for weight in module.parameters():
            spread = weight.float().std() if weight.numel() > 1 else torch.ones((), device=weight.device)
            shake = torch.randn(weight.shape, generator=generator, device="cpu").to(weight.device)  # [*weight.shape]
            weight.add_((noise * spread * shake).to(weight.dtype))
    return HFCausalLM(module=module.to(device or model.device), tokenizer_id=model.tokenizer_id, name=name)


def shipped_draft_as_target(*, seed: int = 0, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> HFCausalLM:
    """The shipped draft (specstack/assets/smollm2-draft: one layer, grouped-query attention 9/3,
    a 49,152-token vocabulary) with a seeded random embedding in place of the target's, which it
    ships without: a real checkpoint that travels with the repository."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from ..models import draft_dir

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the embedding is missing from the file, on purpose
    try:
        module = AutoModelForCausalLM.from_pretrained(Path(draft_dir()), dtype=dtype)
    finally:
        hf_logging.set_verbosity(verbosity)
    embedding = module.get_input_embeddings().weight  # [V, D]; tied to the LM head
    generator = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        embedding.copy_(torch.randn(embedding.shape, generator=generator, device="cpu") * 0.05)
    return HFCausalLM(module=module.to(device), tokenizer_id=TOKENIZER_ID, name="shipped-draft")
