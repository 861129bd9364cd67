"""Each layer one compiled call (``specstack.compiled_layers``): the same bits as the lean decoder's forward
it replaces (logits, the keys and values it writes, the query log, the keys as written of a store with
cache-relative positions), for chains and trees of 1-16 tokens, random Llama, Mistral and Qwen2 models and
the embedded target and draft reading their stored weights; the forwards it does not take keep the lean
decoder's Python; a plan is remade when the weights it points at change; inside a generation
(``weights_held``) the weights are checked once, and changes made between generations are seen; a bf16
activation is read from a table only where the table gives the module's bits for every input."""

from __future__ import annotations

import ctypes
import shutil

import attrs
import pytest
import torch

from specstack.batch import TokenBatch
from specstack.channels import QueryLog
from specstack.compiled_layers import _address, activation_table
from specstack.gguf_weights import attach_gguf_blocks
from specstack.packed_linear import PackedLinear, load_rows_kernel, read_bf16_numbers
from specstack.parameter_watch import ParameterWatch
from specstack.registry import Registry
from specstack.types import Draft, DraftKind

from .test_decoder import CACHED, tiny

pytestmark = pytest.mark.skipif(tiny("llama").decoder.compiled is None, reason="no C++ compiler: the compiled layers cannot be built here")


def chain(t: int, vocab: int) -> TokenBatch:
    return TokenBatch.chain([(5 * i + 3) % vocab for i in range(t)], start=CACHED, num_logits=t)


def tree(t: int, vocab: int) -> TokenBatch:
    """One committed token and a binary tree of t - 1 nodes."""
    k = t - 1
    parents = torch.tensor([(i - 2) // 2 if i >= 2 else -1 for i in range(k)], dtype=torch.long)
    draft = Draft(tokens=torch.tensor([(7 * i + 2) % vocab for i in range(k)]), probs=torch.full((k, vocab), 1 / vocab), parents=parents,
                  kind=DraftKind.TREE_DETERMINISTIC)
    return TokenBatch.tree([11], start=CACHED, draft=draft)


def forward(model, make_batch, *, compiled: bool, relative: bool = False, queries: bool = False) -> dict[str, torch.Tensor]:
    """One forward of ``make_batch()`` after a prefill of CACHED tokens, with the compiled layers or the lean
    decoder's Python: its logits, the keys and values it wrote, what it logged and the keys as written."""
    decoder = model.decoder
    own, decoder.compiled = decoder.compiled, decoder.compiled if compiled else None
    try:
        store = model.new_cache(CACHED + 24, relative_positions=relative)
        model.forward(TokenBatch.chain((torch.arange(CACHED) * 7 % model.vocab_size).tolist(), start=0, num_logits=1), store)
        batch = make_batch()
        batch.queries = QueryLog() if queries else None
        before = own.forwards
        logits = model.forward(batch, store)
        took = own.forwards > before
        new = slice(CACHED, CACHED + len(batch))
        out = {"logits": logits, "keys": store.keys[:, :, new], "values": store.values[:, :, new], "took": torch.tensor(took)}
        if queries:
            out["queries"] = batch.queries.queries
        if relative:
            out["written"] = store.written[:, :, new]
        return out
    finally:
        decoder.compiled = own


def same_bits(a: dict, b: dict) -> bool:
    return all(torch.equal(a[k], b[k]) for k in a if k != "took")


_KERNEL = tiny("llama").attention_kernel
_ROWS = load_rows_kernel()
FP32_TOKENS = [t for t in (1, 2, 3, 6, 16) if _ROWS is not None and t <= _ROWS.max_rows(torch.float32)]  # 1-6, 1-16 on AVX2
BF16_TOKENS = [t for t in (1, 2, 3, 4, 8, 16) if _KERNEL is not None and t <= _KERNEL.max_tokens(torch.bfloat16, 16)]  # 1-4, 1-16 on AVX2


@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2"])
@pytest.mark.parametrize(("dtype", "tokens"), [(torch.float32, t) for t in FP32_TOKENS] + [(torch.bfloat16, t) for t in BF16_TOKENS])
def test_compiled_layers_give_the_lean_decoders_bits(kind, dtype, tokens) -> None:
    """Logits, the keys and values written, and the query log of a gathering level below: the same bits, chains and
    trees, float32 and bfloat16 (as many tokens as the few-row linear kernel and the attention kernel take on this CPU)."""
    model = tiny(kind, dtype)
    shapes = [chain] + ([tree] if tokens >= 3 else [])
    for shape in shapes:
        make = lambda: shape(tokens, model.vocab_size)  # noqa: E731
        compiled = forward(model, make, compiled=True, queries=True)
        assert compiled["took"], "the forward did not take the compiled layers"
        assert same_bits(compiled, forward(model, make, compiled=False, queries=True))
    if dtype == torch.bfloat16:  # every layer's activation from its table: the whole forward was one call
        assert model.decoder.compiled.plans[tokens].tables is not None


def test_a_store_with_cache_relative_positions_keeps_its_keys_as_written() -> None:
    """A draft's StreamingLLM store keeps each key as written beside the rotated one: the compiled layers write both."""
    model = tiny("llama")
    make = lambda: chain(4, model.vocab_size)  # noqa: E731
    compiled = forward(model, make, compiled=True, relative=True)
    assert compiled["took"] and compiled["written"].abs().sum() > 0
    assert same_bits(compiled, forward(model, make, compiled=False, relative=True))


def test_forwards_the_compiled_layers_do_not_take_keep_the_lean_decoder() -> None:
    """More tokens than the kernels take (fp32, and bf16 past what its attention kernel takes), a prefill over an
    empty store, recorded attention weights (H2O): the lean decoder's Python runs them, and says so by leaving
    the plans alone."""
    model, wide = tiny("llama"), tiny("llama", torch.bfloat16)
    compiled = model.decoder.compiled
    assert forward(wide, lambda: chain(2, 256), compiled=True)["took"]
    attention = wide.attention_kernel
    too_many = attention.max_tokens(torch.bfloat16, wide.module.model.layers[0].self_attn.head_dim) + 1
    assert not forward(wide, lambda: chain(too_many, 256), compiled=True)["took"]
    assert not forward(model, lambda: chain(17, 256), compiled=True)["took"]

    def recorded() -> TokenBatch:
        batch = chain(2, 256)
        batch.record_attention = True
        return batch

    assert not forward(model, recorded, compiled=True)["took"]
    store, before = model.new_cache(8), compiled.forwards
    model.forward(TokenBatch.chain([1, 2, 3], start=0, num_logits=3), store)  # nothing cached yet: SDPA's causal kernel
    assert compiled.forwards == before


def test_a_plan_is_remade_when_the_weights_it_reads_change() -> None:
    """Weights replaced (``.data =``) and weights changed in place after being read as bf16 numbers: the compiled
    forward follows them (a plan kept from before would read the old storage, or blocks that no longer widen
    to the weight)."""
    model = tiny("llama")
    with torch.no_grad():
        for linear in model.module.modules():
            if isinstance(linear, PackedLinear):
                linear.weight.copy_(linear.weight.to(torch.bfloat16).float())  # bf16 numbers held as fp32
    assert read_bf16_numbers(model.module) > 0
    model.decoder.attach_part_blocks()
    make = lambda: chain(2, model.vocab_size)  # noqa: E731
    assert same_bits(forward(model, make, compiled=True), forward(model, make, compiled=False))
    attention = model.module.model.layers[0].self_attn
    with torch.no_grad():
        attention.o_proj.weight.mul_(1.001)  # no longer bf16 numbers: its blocks must be dropped
        attention.o_proj.weight.data = attention.o_proj.weight.detach().clone() * 2  # and new storage
    changed = forward(model, make, compiled=True)
    assert changed["took"] and same_bits(changed, forward(model, make, compiled=False))


def test_a_plan_is_remade_when_the_kernels_it_chose_from_change(tmp_path) -> None:
    """A plan keeps the kernel entries its products' few-row kernel chose: switched to another build of that kernel
    (the same source loaded from another file: other entry addresses), or to one taking the tiles from another row
    count, the next forward takes a plan made from what the products hold now, and gives the same bits."""
    model = tiny("llama")
    make = lambda: chain(2, model.vocab_size)  # noqa: E731
    before = forward(model, make, compiled=True)
    linears = [m for m in model.module.modules() if isinstance(m, PackedLinear)] + [p.linear for p in model.decoder.products()]
    (tmp_path / "kernels").mkdir()
    shutil.copy(_ROWS.path, tmp_path / "kernels" / _ROWS.path.name)  # found there as built: loaded apart, not compiled again
    other = load_rows_kernel(cache=tmp_path)
    assert other is not None and other.library is not _ROWS.library
    for linear in linears:
        linear._rows = other
    after = forward(model, make, compiled=True)
    entry = model.decoder.compiled.plans[2].model.layers[0].o.entry
    assert after["took"] and same_bits(after, before)
    assert entry == _address(model.module.model.layers[0].self_attn.o_proj.rows_product(2)[0])  # the new build's entry
    plan = model.decoder.compiled.plans[2]
    for linear in linears:
        linear._rows = attrs.evolve(other, tiles_from=other.tiles_from + 1)
    forward(model, make, compiled=True)
    assert model.decoder.compiled.plans[2] is not plan


def test_an_activation_table_is_refused_where_it_would_change_a_bit() -> None:
    """activation_table gives SiLU's table on rows of 128 (the tiny models' MLP width) and refuses: a C product that
    differs from torch's in one bit of one of the 65,536 gate values, a width with a scalar tail (96), and an
    activation with parameters (PReLU)."""
    kernel = tiny("llama").decoder.compiled.library.specstack_tabled_act
    silu = torch.nn.SiLU()
    assert activation_table(silu, 128, kernel) is not None

    def one_bit_off(table, gate_up, out, rows, inner, threads):
        kernel(table, gate_up, out, rows, inner, threads)
        word = ctypes.c_uint16.from_address(out + 2 * 777)
        word.value ^= 1

    assert activation_table(silu, 128, one_bit_off) is None
    assert activation_table(silu, 96, kernel) is None
    assert activation_table(torch.nn.PReLU().to(torch.bfloat16), 128, kernel) is None


def counted_checks(monkeypatch) -> list[int]:
    """A list that grows by one at each ParameterWatch.current() (the decoder's check of its fused layers, a plan's of
    the weights it reads)."""
    calls: list[int] = []
    current = ParameterWatch.current

    def counting(watch: ParameterWatch) -> bool:
        calls.append(1)
        return current(watch)

    monkeypatch.setattr(ParameterWatch, "current", counting)
    return calls


def test_weights_held_checks_each_once(monkeypatch) -> None:
    """Inside weights_held the decoder's check and each width's plan check run at their first forward only; outside,
    before every forward. Fails where the scope is ignored (every forward checks) or never closes."""
    model = tiny("llama")
    store = model.new_cache(CACHED + 24)
    model.forward(TokenBatch.chain(list(range(CACHED)), start=0, num_logits=1), store)
    make = lambda t: TokenBatch.chain([3] * t, start=len(store), num_logits=t)  # noqa: E731
    model.forward(make(1), store)
    model.forward(make(2), store)  # both widths' plans exist before the scope opens
    calls = counted_checks(monkeypatch)
    with model.weights_held():
        for t in (1, 1, 1, 2, 2, 1):
            model.forward(make(t), store)
    assert len(calls) == 3  # the layers once, the plans of 1 and 2 tokens once each
    model.forward(make(1), store)
    model.forward(make(1), store)
    assert len(calls) == 3 + 4  # closed: both checks before every forward


def test_a_generation_checks_the_weights_once_and_sees_changes_made_before_the_next(monkeypatch) -> None:
    """SpeculationStack.generate holds its models' weights: a 12-token autoregressive run checks them a few times, not
    twice a forward; weights replaced between two runs (new storage) are read by the next one, whose tokens are then
    the lean decoder's Python's over the new weights."""
    model = tiny("llama")
    stack = Registry.create().stack("autoregressive", target=model)
    prompt = [(7 * i) % model.vocab_size for i in range(CACHED)]
    stack.generate(prompt, 4)
    calls = counted_checks(monkeypatch)
    stack.generate(prompt, 12)
    assert 0 < len(calls) <= 4
    with torch.no_grad():
        o_proj = model.module.model.layers[0].self_attn.o_proj
        o_proj.weight.data = o_proj.weight.detach().clone() * 3
    changed = stack.generate(prompt, 12).tokens
    decoder = model.decoder
    own, decoder.compiled = decoder.compiled, None
    try:
        python = stack.generate(prompt, 12).tokens
    finally:
        decoder.compiled = own
    assert changed == python


def test_stored_weights_attached_after_a_plan_was_made_are_read() -> None:
    """The plan is remade when a product is given a narrower stored weight: it then reads those bytes, with the same bits."""
    model = tiny("llama")
    with torch.no_grad():
        for linear in model.module.modules():
            if isinstance(linear, PackedLinear):
                linear.weight.copy_(linear.weight.to(torch.bfloat16).float())  # bf16 numbers held as fp32
    make = lambda: chain(2, model.vocab_size)  # noqa: E731
    before = forward(model, make, compiled=True)
    assert read_bf16_numbers(model.module) > 0
    model.decoder.attach_part_blocks()
    after = forward(model, make, compiled=True)
    o_proj = model.module.model.layers[0].self_attn.o_proj
    assert model.decoder.compiled.plans[2].model.layers[0].o.weight == o_proj._blocks.data_ptr()
    assert after["took"] and same_bits(after, before)


@pytest.mark.real_model
def test_the_embedded_models_compiled_forwards_are_the_same_bits() -> None:
    """The target reading its Q4_1 and Q8_0 blocks and the draft reading bf16 numbers, fp32: steps, verifies of
    three and 16 tokens and a tree, with and without the compiled layers."""
    from specstack.models import find_gguf, load_default

    target, draft, _ = load_default()
    assert attach_gguf_blocks(target.module, find_gguf()) > 0
    tokens = [1, 504, 3458, 314, 253, 1345, 2330, 30] * 3

    def run(model) -> list[torch.Tensor]:
        store = model.new_cache(40)
        model.forward(TokenBatch.chain(tokens[:5], start=0, num_logits=1), store)
        steps = [model.forward(TokenBatch.chain([t], start=5 + i, num_logits=1), store) for i, t in enumerate(tokens[5:8])]
        store.truncate(5)
        verify = model.forward(TokenBatch.chain(tokens[5:8], start=5, num_logits=3), store)
        store.truncate(4)
        wide = model.forward(TokenBatch.chain(tokens[4:20], start=4, num_logits=16), store)
        store.truncate(5)
        draft_tree = Draft(tokens=torch.tensor(tokens[6:12]), probs=torch.zeros(6, model.vocab_size),
                           parents=torch.tensor([-1, -1, 0, 0, 1, 2]), kind=DraftKind.TREE_DETERMINISTIC)
        branching = model.forward(TokenBatch.tree(tokens[5:6], start=5, draft=draft_tree), store)
        return [*steps, verify, wide, branching, store.keys[:, :, :12].clone(), store.values[:, :, :12].clone()]

    for model in (target, draft):
        compiled = run(model)
        plans = model.decoder.compiled.plans
        assert {1, 3, 16, 7} <= set(plans) and all(plan.model is not None for t, plan in plans.items() if t <= _ROWS.max_rows(torch.float32))
        assert any(plan.model is not None for t, plan in plans.items() if t > 1)  # a verify took them (16 and 7 rows on AVX2, 3 with AVX-512)
        own, model.decoder.compiled = model.decoder.compiled, None
        try:
            lean = run(model)
        finally:
            model.decoder.compiled = own
        assert all(torch.equal(a, b) for a, b in zip(compiled, lean))


@pytest.mark.real_model
def test_the_embedded_targets_bf16_compiled_forwards_are_the_same_bits() -> None:
    """The bf16 target reading its Q4_1 blocks: steps and a verify of three tokens (a gathering level's query
    log kept), with and without the compiled layers."""
    from specstack.models import load_target

    target = load_target(dtype=torch.bfloat16)[0]
    tokens = [1, 504, 3458, 314, 253, 1345, 2330, 30]

    def run() -> list[torch.Tensor]:
        store = target.new_cache(16)
        target.forward(TokenBatch.chain(tokens[:5], start=0, num_logits=1), store)
        steps = [target.forward(TokenBatch.chain([t], start=5 + i, num_logits=1), store) for i, t in enumerate(tokens[5:8])]
        store.truncate(5)
        verify = TokenBatch.chain(tokens[5:8], start=5, num_logits=3)
        verify.queries = QueryLog()
        logits = target.forward(verify, store)
        return [*steps, logits, verify.queries.queries.clone(), store.keys[:, :, :8].clone(), store.values[:, :, :8].clone()]

    compiled = run()
    plans = target.decoder.compiled.plans
    assert {1, 3} <= set(plans) and all(plans[t].model is not None for t in (1, 3))
    own, target.decoder.compiled = target.decoder.compiled, None
    try:
        lean = run()
    finally:
        target.decoder.compiled = own
    assert all(torch.equal(a, b) for a, b in zip(compiled, lean))
