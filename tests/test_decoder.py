"""The lean CPU decoder (``specstack.decoder``): the same logits as the transformers forward it
replaces, for chains and trees, Llama, Mistral and Qwen2 (biased q/k/v), fp32 and bf16 (the same bits
with torch's small operations, within a float32 last place with the compiled ones of
``specstack.decoder_ops``); the module's weights unchanged in value; weights replaced after fusing
are fused again before the next forward."""

from __future__ import annotations

import pytest
import torch

from specstack.batch import TokenBatch
from specstack.decoder import MAX_TOKENS, LeanDecoder
from specstack.decoder_ops import TORCH_OPS, DecoderOps, load_decoder_ops
from specstack.hf import HFCausalLM
from specstack.testing.llama import random_llama
from specstack.types import Draft, DraftKind

CACHED = 40  # slots filled by a prefill before the compared forward


def tiny(kind: str, dtype: torch.dtype = torch.float32) -> HFCausalLM:
    """A seeded random model of ``kind``: llama (the shared test model), mistral, or qwen2 (q/k/v biases)."""
    if kind == "llama":
        return random_llama(dtype=dtype)
    from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

    config_class, model_class = {"mistral": (MistralConfig, MistralForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}[kind]
    config = config_class(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          max_position_embeddings=512, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        module = model_class(config)
        if kind == "qwen2":  # transformers initialises biases to zero: make them count
            for layer in module.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    torch.nn.init.normal_(proj.bias, std=0.5)
    return HFCausalLM(module=module.to(dtype), tokenizer_id="random", name=kind)


def logits(model: HFCausalLM, batch_of, *, lean: bool, ops=None) -> torch.Tensor:
    """The model's logits for one batch after a prefill of CACHED tokens, through the lean decoder (with
    ``ops``, default its own) or not."""
    decoder = model.decoder
    model.decoder = decoder if lean else None
    own = None if decoder is None else decoder.ops
    if decoder is not None:
        decoder.ops = ops or own
    try:
        store = model.new_cache(CACHED + 16)
        prompt = torch.arange(CACHED) * 7 % model.vocab_size
        model.forward(TokenBatch.chain(prompt.tolist(), start=0, num_logits=1), store)
        return model.forward(batch_of(), store)
    finally:
        model.decoder = decoder
        if decoder is not None:
            decoder.ops = own


@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 3, 6])
def test_lean_forward_gives_the_transformers_forward_bits(kind, dtype, tokens) -> None:
    """Up to the few-row kernel's six rows each output is summed in the same order on both paths; with
    torch's small operations the logits are the same bits, with the compiled ones (which sum the norms'
    squares in another order) the same to a float32 last place."""
    model = tiny(kind, dtype)
    assert model.decoder is not None
    chain = [(5 * i + 3) % model.vocab_size for i in range(tokens)]
    batch = lambda: TokenBatch.chain(chain, start=CACHED, num_logits=tokens)  # noqa: E731
    plain = logits(model, batch, lean=False)
    assert torch.equal(logits(model, batch, lean=True, ops=TORCH_OPS), plain)
    compiled = logits(model, batch, lean=True)
    tolerance = 1e-5 if dtype == torch.float32 else 0.05
    assert isinstance(model.decoder.ops, DecoderOps) and (compiled - plain).abs().max() <= tolerance


def _norm(dtype: torch.dtype, width: int = 64):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    norm = LlamaRMSNorm(width, eps=1e-5)
    with torch.no_grad():
        norm.weight.normal_()
    return norm.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_small_operations_follow_transformers_row_by_row(dtype) -> None:
    """The residual add and the rotation give torch's bits; the norm is torch's to a float32 last place
    (bf16: almost always the same bits); each row's results are the same alone or among six."""
    ops = load_decoder_ops()
    assert isinstance(ops, DecoderOps)
    generator = torch.Generator().manual_seed(0)
    hidden, delta = (torch.randn(1, 6, 64, generator=generator).to(dtype) for _ in range(2))
    norm = _norm(dtype)
    summed, normed = ops.add_norm(hidden.clone(), delta, norm)
    reference_sum, reference_norm = TORCH_OPS.add_norm(hidden, delta, norm)
    assert torch.equal(summed, reference_sum)
    assert torch.allclose(normed.float(), reference_norm.float(), rtol=1e-6 if dtype == torch.float32 else 2**-7, atol=0)
    assert torch.equal(ops.add_norm(hidden[:, 4:5].clone(), delta[:, 4:5].contiguous(), norm)[1], normed[:, 4:5])
    qkv = torch.randn(1, 6, 7, 16, generator=generator).to(dtype)  # 5 heads rotated, 2 not
    cos, sin = (torch.randn(1, 6, 1, 16, generator=generator).to(dtype) for _ in range(2))
    rotated = ops.rotate(qkv.clone(), cos, sin, 5)
    assert torch.equal(rotated, TORCH_OPS.rotate(qkv, cos, sin, 5))
    assert torch.equal(ops.rotate(qkv[:, 2:3].clone(), cos[:, 2:3].contiguous(), sin[:, 2:3].contiguous(), 5), rotated[:, 2:3])


def test_compiled_operations_leave_what_they_do_not_know_to_torch() -> None:
    """A norm of another formula, a float16 tensor or a view with strides keeps torch's operations."""
    ops = load_decoder_ops()

    class OtherNorm(torch.nn.Module):
        weight = torch.ones(64)
        variance_epsilon = 1e-5

        def forward(self, x):
            return x * 2

    hidden = torch.randn(1, 3, 64)
    assert torch.equal(ops.add_norm(hidden.clone(), None, OtherNorm())[1], hidden * 2)
    strided, norm32 = torch.randn(1, 64, 3).transpose(1, 2), _norm(torch.float32)  # [1, 3, 64], not contiguous
    assert torch.equal(ops.add_norm(strided, None, norm32)[1], TORCH_OPS.add_norm(strided, None, norm32)[1])
    half, norm = torch.randn(1, 3, 64).half(), _norm(torch.float16)
    assert torch.equal(ops.add_norm(half.clone(), None, norm)[1], TORCH_OPS.add_norm(half, None, norm)[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lean_forward_matches_on_trees_and_wide_verifies(dtype) -> None:
    """A token tree (its own mask) and a 16-token chain (oneDNN's products) agree to rounding."""
    model = tiny("llama", dtype)
    parents = torch.tensor([-1, -1, 0, 0, 1, 2], dtype=torch.long)
    draft = Draft(tokens=torch.tensor([9, 8, 7, 6, 5, 4]), probs=torch.full((6, 256), 1 / 256), parents=parents, kind=DraftKind.TREE_DETERMINISTIC)
    tree = lambda: TokenBatch.tree([11], start=CACHED, draft=draft)  # noqa: E731
    wide = lambda: TokenBatch.chain([(3 * i + 1) % 256 for i in range(16)], start=CACHED, num_logits=16)  # noqa: E731
    tolerance = 1e-4 if dtype == torch.float32 else 0.1
    for batch in (tree, wide):
        lean, plain = logits(model, batch, lean=True), logits(model, batch, lean=False)
        assert lean.shape == plain.shape and (lean - plain).abs().max() <= tolerance


def test_fusing_leaves_the_weights_and_state_dict_as_they_were() -> None:
    before = random_llama(seed=3, packed_linears=False, lean_decoder=False).module.state_dict()  # same seed, never fused
    model = random_llama(seed=3)
    after = model.module.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[name], before[name]) for name in before)
    attention = model.module.model.layers[0].self_attn
    fused = model.decoder.layers[0].qkv.linear.weight
    assert attention.k_proj.weight.data_ptr() == fused.data_ptr() + attention.q_proj.weight.numel() * fused.element_size()  # a view, no copy


def test_weights_replaced_after_fusing_are_fused_again() -> None:
    """New weights (a load, ``.data =``, ``.to()``) reach the lean forward: a decoder that kept its old
    fused matrices would give the old model's logits."""
    model = random_llama(seed=4)
    other = random_llama(seed=5, lean_decoder=False)
    with torch.no_grad():
        for mine, theirs in zip(model.module.parameters(), other.module.parameters()):
            mine.data = theirs.detach().clone()  # new storage for every parameter
    batch = lambda: TokenBatch.chain([1, 2, 3], start=CACHED, num_logits=3)  # noqa: E731
    assert torch.equal(logits(model, batch, lean=True, ops=TORCH_OPS), logits(other, batch, lean=False))
    model.module.to(torch.bfloat16)
    assert torch.equal(logits(model, batch, lean=True, ops=TORCH_OPS), logits(model, batch, lean=False))


def test_a_decoder_it_does_not_know_keeps_the_transformers_forward() -> None:
    model = random_llama()
    del model.module.model.layers[1].mlp.up_proj  # a layer without the parts the lean forward computes
    assert LeanDecoder.build(model.module) is None


def test_prefill_chunks_keep_the_transformers_forward() -> None:
    """Forwards wider than MAX_TOKENS (a prefill chunk) measured slower on the lean path."""
    decoder = random_llama().decoder
    assert decoder.applies(torch.zeros(1, MAX_TOKENS, dtype=torch.long))
    assert not decoder.applies(torch.zeros(1, MAX_TOKENS + 1, dtype=torch.long))
