"""The linear kernels specstack's models use on the CPU (``specstack.packed_linear``): the layer's own
outputs up to rounding for every row count (a few rows through the compiled streaming kernel, more
through oneDNN),
``F.linear`` itself wherever they do not apply, and never a stale packed weight."""

from __future__ import annotations

import copy
import io

import pytest
import torch

from specstack.native import find_compiler
from specstack.packed_linear import MAX_STREAMED_ROWS, MAX_TILE_ROWS, MAX_WIDENED_BF16_ROWS, TILES_FROM, PackedLinear, RowsKernel, load_rows_kernel, onednn_available, onednn_bf16_available, pack_linears
from specstack.weight_formats import Q4_1
from tests.test_gguf_weights import bf16_layer, random_blocks

ROWS_KERNEL = load_rows_kernel()
# the most fp32 rows the streaming kernel takes (sixteen on any build)
FP32_ROWS = ROWS_KERNEL.max_rows(torch.float32) if ROWS_KERNEL is not None else MAX_STREAMED_ROWS[torch.float32]
BF16_ROWS = MAX_STREAMED_ROWS[torch.bfloat16] if ROWS_KERNEL is None or ROWS_KERNEL.bf16_dots else MAX_WIDENED_BF16_ROWS  # the most bf16 rows the streaming kernel takes
pytestmark = pytest.mark.skipif(not onednn_available(), reason="this torch build has no oneDNN linear ops")


def packed(in_features: int = 64, out_features: int = 1000, *, bias: bool = False, seed: int = 0) -> torch.nn.Linear:
    torch.manual_seed(seed)
    layer = torch.nn.Linear(in_features, out_features, bias=bias)
    assert pack_linears(torch.nn.Sequential(layer)) == 1 and type(layer) is PackedLinear
    return layer


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 2, 3, 8, 33, 512])
def test_a_packed_linear_is_the_linear_layer_up_to_rounding(rows, bias) -> None:
    layer = packed(bias=bias)
    hidden = torch.randn(1, 600, 64)[:, -rows:]  # [1, rows, H], a view as a decoder passes it
    with torch.inference_mode():
        got = layer(hidden)  # [1, rows, V]
    want = torch.nn.functional.linear(hidden, layer.weight, layer.bias)  # [1, rows, V]
    assert (layer._packed is None) == (rows <= FP32_ROWS and layer._rows is not None)  # a few rows streamed; more: oneDNN
    assert got.shape == want.shape == (1, rows, 1000)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


needs_compiler = pytest.mark.skipif(find_compiler() is None, reason="no C++ compiler here: the kernel cannot be built")


@needs_compiler
@pytest.mark.parametrize(("in_features", "out_features", "bias", "shape"), [
    (576, 1536, False, (1, 1)),  # the default target's MLP, a decoder's [1, 1, H]
    (1536, 576, True, (1, 2)),  # its down projection with a bias, two tokens: a pair of rows
    (64, 1003, True, (2,)),  # output rows not a multiple of the four streamed together
    (8, 5, False, ()),  # the narrowest input it takes, a bare [H]
    (576, 40, True, (FP32_ROWS,)),  # the most rows it takes
])
def test_a_few_rows_take_the_streaming_kernel_and_are_the_linear_layer_up_to_rounding(monkeypatch, in_features, out_features, bias, shape) -> None:
    calls = []
    call = RowsKernel.__call__
    monkeypatch.setattr(RowsKernel, "__call__", lambda self, *args: calls.append(1) or call(self, *args))
    layer = packed(in_features, out_features, bias=bias)
    assert layer._rows is not None
    hidden = 3 * torch.randn(*shape, in_features)  # [..., in]
    with torch.inference_mode():
        got = layer(hidden)  # [..., out]
        assert layer(torch.randn(FP32_ROWS + 1, in_features)).shape == (FP32_ROWS + 1, out_features)
    assert len(calls) == 1  # the wider forward went to oneDNN
    want = torch.nn.functional.linear(hidden.double(), layer.weight.double(), None if layer.bias is None else layer.bias.double())
    assert got.shape == want.shape == (*shape, out_features) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=0, atol=2e-5)


@needs_compiler
def test_a_rows_outputs_are_the_same_bits_alone_or_among_others() -> None:
    layer = packed(576, 1003, bias=True)
    hidden = torch.randn(FP32_ROWS, 576)  # [T, H]
    with torch.inference_mode():
        together = layer(hidden)  # [T, V]
        for count in range(1, FP32_ROWS + 1):
            assert torch.equal(layer(hidden[:count]), together[:count])
            assert torch.equal(layer(hidden[count - 1 : count]), together[count - 1 : count])


@needs_compiler
def test_fp32_takes_up_to_sixteen_rows() -> None:
    """The one place the row limit is chosen (MAX_STREAMED_ROWS): sixteen fp32 rows on any build, then oneDNN."""
    assert ROWS_KERNEL is not None
    assert ROWS_KERNEL.max_rows(torch.float32) == MAX_STREAMED_ROWS[torch.float32] == 16
    weight = torch.randn(40, 64)  # [out, in]
    assert ROWS_KERNEL.applies(torch.randn(16, 64), weight, None) and not ROWS_KERNEL.applies(torch.randn(17, 64), weight, None)


needs_bf16_rows = pytest.mark.skipif(ROWS_KERNEL is None, reason="no C++ compiler here: bf16 rows keep F.linear")
needs_tiles = pytest.mark.skipif(ROWS_KERNEL is None or not ROWS_KERNEL.tiles, reason="no AMX tiles here: wider bf16 products take oneDNN")
BF16_KERNEL_ROWS = ROWS_KERNEL.max_rows(torch.bfloat16) if ROWS_KERNEL is not None else 0  # 16, or 64 on AMX tiles
# bf16 products each way the kernel was built for: the way chosen here (specstack.bf16_products), and where it was built
# with bf16 dot products the other way too (widened, or the dot products)
BF16_WAYS = [] if ROWS_KERNEL is None else ROWS_KERNEL.bf16_ways()
each_bf16_way = pytest.mark.parametrize("kernel", BF16_WAYS, ids=lambda kernel: "dots" if kernel.bf16_dots else "widened")


@needs_bf16_rows
@pytest.mark.parametrize(("in_features", "out_features", "bias", "shape"), [
    (576, 1536, False, (1, 1)),  # the default target's MLP
    (1536, 576, True, (1, 2)),  # its down projection with a bias, two tokens
    (64, 1003, True, (BF16_ROWS,)),  # output rows not a multiple of four, the most rows the streaming kernel takes
    (32, 5, False, ()),  # the narrowest input it takes, a bare [H]
    (576, 1003, True, (1, min(8, BF16_KERNEL_ROWS))),  # a verify of eight (of six where the streaming kernel's bf16 dot products stop there): the tiles where there are tiles; a short last group of sixteen
    (96, 40, False, (min(17, BF16_KERNEL_ROWS),)),  # two B tiles, the second of one row (on tiles)
    (64, 1003, True, (max(BF16_KERNEL_ROWS, 1),)),  # the most rows the kernel takes
])
@each_bf16_way
def test_bf16_rows_take_the_kernel_and_are_the_linear_layer_rounded_once(monkeypatch, kernel, in_features, out_features, bias, shape) -> None:
    """bf16: each output is the exact product of the bf16 numbers, summed in float32 and rounded once
    to bf16 (half a bf16 ulp, at most 2^-8 relative, plus the float32 sum's error), by bf16 dot products or widened
    where both are built; one more row than the kernel takes goes to oneDNN (packed: its bf16 kernels, or where it
    has none the weight widened to fp32)."""
    calls = []
    call = RowsKernel.__call__
    monkeypatch.setattr(RowsKernel, "__call__", lambda self, *args: calls.append(1) or call(self, *args))
    layer = packed(in_features, out_features, bias=bias).to(torch.bfloat16)
    layer._rows = kernel
    hidden = (3 * torch.randn(*shape, in_features)).bfloat16()  # [..., in]
    with torch.inference_mode():
        got = layer(hidden)  # [..., out]
        assert layer._packed is None
        wide = torch.randn(BF16_KERNEL_ROWS + 1, in_features).bfloat16()
        exact = torch.nn.functional.linear(wide.double(), layer.weight.double(), None if layer.bias is None else layer.bias.double())
        torch.testing.assert_close(layer(wide).double(), exact, rtol=2**-7, atol=1e-2)  # wider: oneDNN
    assert len(calls) == 1 and layer._packed is not None
    want = torch.nn.functional.linear(hidden.double(), layer.weight.double(), None if layer.bias is None else layer.bias.double())
    assert got.shape == want.shape == (*shape, out_features) and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), want, rtol=2**-8, atol=1e-5)


@needs_bf16_rows
@each_bf16_way
def test_a_bf16_rows_outputs_are_the_same_bits_alone_or_among_others(kernel) -> None:
    """Up to the row count where the tiles take over (all the streaming kernel takes where there are none),
    a row's outputs are the same bits alone or among others, by bf16 dot products or widened where both are built;
    from there on, the same bits in any product on the tiles."""
    layer = packed(576, 1003, bias=True).to(torch.bfloat16)
    layer._rows = kernel
    streamed = TILES_FROM - 1 if ROWS_KERNEL.tiles else BF16_ROWS
    hidden = torch.randn(BF16_KERNEL_ROWS, 576).bfloat16()  # [T, H]
    with torch.inference_mode():
        together = layer(hidden[:streamed])  # [T, V]
        for count in range(1, streamed + 1):
            assert torch.equal(layer(hidden[count - 1 : count]), together[count - 1 : count])
        if ROWS_KERNEL.tiles:
            tiled = layer(hidden)  # [32, V]
            for count in range(TILES_FROM, BF16_KERNEL_ROWS):
                assert torch.equal(layer(hidden[:count]), tiled[:count]), count
                assert torch.equal(layer(hidden[BF16_KERNEL_ROWS - count :]), tiled[BF16_KERNEL_ROWS - count :]), count


@needs_tiles
def test_the_tiles_sum_what_the_streaming_kernel_sums() -> None:
    """The same products on the tiles and in the streaming kernel: each rounded once from float32 sums
    taken in different orders, so at most one bf16 step apart."""
    layer = packed(1536, 576, bias=True).to(torch.bfloat16)
    hidden = torch.randn(TILES_FROM, 1536).bfloat16()  # [T, H]
    with torch.inference_mode():
        tiled = layer(hidden)  # [T, V]
        streamed = torch.cat([layer(hidden[i : i + 1]) for i in range(TILES_FROM)])  # [T, V]
    exact = torch.nn.functional.linear(hidden.double(), layer.weight.double(), layer.bias.double())
    step = 2.0 ** (torch.floor(torch.log2(exact.abs().clamp_min(1e-30))) - 7)  # one bf16 step at each output's size
    assert ((tiled.double() - streamed.double()).abs() <= step).all()
    torch.testing.assert_close(tiled.double(), exact, rtol=2**-8, atol=1e-5)


@needs_tiles
@pytest.mark.parametrize("rows", [33, 47, 64])
def test_tile_products_past_32_rows_take_a_second_pass_with_each_rows_own_bits(rows) -> None:
    """Past 32 rows the tile entries take a second pass over the weight: each row's outputs are the bits a product of
    its pass's rows alone gives it, within bf16 rounding of the exact product, for stored Q4_1 blocks and for a bf16
    weight. A second pass skipped or fed the first pass's rows fails both."""
    dense = packed(576, 1003, bias=True).to(torch.bfloat16)
    blocks = random_blocks(1536, 576, seed=5)
    stored = bf16_layer(blocks, bias=False)  # [out, in]: the numbers the blocks stand for
    assert stored.attach_exact_blocks(blocks, Q4_1)
    hidden = torch.randn(rows, 576, generator=torch.Generator().manual_seed(6)).bfloat16()  # [T, H]
    with torch.inference_mode():
        for layer in (dense, stored):
            together = layer(hidden)  # [T, V]
            assert torch.equal(together[:32], layer(hidden[:32])) and torch.equal(together[32:], layer(hidden[32:]))
            exact = torch.nn.functional.linear(hidden.double(), layer.weight.double(), None if layer.bias is None else layer.bias.double())
            torch.testing.assert_close(together.double(), exact, rtol=2**-7, atol=1e-2)


@needs_compiler
@pytest.mark.parametrize("bias", [False, True])
def test_wider_bf16_products_without_onednn_bf16_kernels_are_the_fp32_product_rounded_once(bias) -> None:
    """Where oneDNN has no bf16 kernels (AVX2), a bf16 product wider than the kernel takes (a prefill chunk) widens to
    an fp32 copy of the weight packed once: each output the fp32 sum of the exact products, rounded once, so within
    half a bf16 step (plus the fp32 sum's error) of the float64 product; emulated bf16 F.linear rounds more often."""
    layer = packed(576, 1003, bias=bias).to(torch.bfloat16)
    layer._bf16_packs = False  # as on such a CPU
    wider = (ROWS_KERNEL.max_rows(torch.bfloat16) if ROWS_KERNEL is not None else 32) + 8  # more rows than the kernel takes
    hidden = (3 * torch.randn(wider, 576, generator=torch.Generator().manual_seed(4))).bfloat16()  # [T, H]
    with torch.inference_mode():
        got = layer(hidden)  # [T, V] bf16
    assert layer._packed is not None and layer._packed.dtype == torch.float32 and got.dtype == torch.bfloat16
    exact = torch.nn.functional.linear(hidden.double(), layer.weight.double(), None if layer.bias is None else layer.bias.double())  # [T, V]
    step = 2.0 ** (torch.floor(torch.log2(exact.abs().clamp_min(1e-30))) - 8)  # half a bf16 step at each output's size
    assert ((got.double() - exact).abs() <= step * 1.01 + 1e-6).all()


needs_widened_bf16 = pytest.mark.skipif(ROWS_KERNEL is None or ROWS_KERNEL.bf16_dots, reason="bf16 rows take AVX-512's bf16 dot products here, not widening")


@needs_widened_bf16
@pytest.mark.parametrize("rows", [1, 2, 5, 7, 16])
def test_without_bf16_dot_products_bf16_rows_are_the_fp32_kernels_sums_rounded_once(monkeypatch, rows) -> None:
    """Where the CPU has no bf16 dot products (AVX2, or AVX-512 without them), a bf16 product of up to
    MAX_WIDENED_BF16_ROWS rows is the fp32 kernel's product of the same numbers widened (bias included), rounded once
    to bf16: bit for bit. (The fp32 product is asked of the kernel itself: with AVX-512, a layer gives fp32 products of
    more than six rows to oneDNN.) Beside AMX tiles, only the rows below TILES_FROM are widened; the tiles take the rest."""
    if ROWS_KERNEL.tiles and rows >= TILES_FROM:
        pytest.skip("AMX tiles take this many bf16 rows here")
    layer = packed(576, 1003, bias=True).to(torch.bfloat16)
    wide = packed(576, 1003, bias=True)  # fp32, the same numbers
    with torch.no_grad():
        wide.weight.copy_(layer.weight.float()), wide.bias.copy_(layer.bias.float())
    hidden = (3 * torch.randn(rows, 576, generator=torch.Generator().manual_seed(rows))).bfloat16()  # [T, H]
    dtypes = []
    call = RowsKernel.__call__
    monkeypatch.setattr(RowsKernel, "__call__", lambda self, x, *args: dtypes.append(x.dtype) or call(self, x, *args))
    with torch.inference_mode():
        got = layer(hidden)  # [T, V] bf16
        want = ROWS_KERNEL(hidden.float(), wide.weight, wide.bias).bfloat16()  # [T, V]
    assert ROWS_KERNEL.max_rows(torch.bfloat16) == (MAX_TILE_ROWS if ROWS_KERNEL.tiles else MAX_WIDENED_BF16_ROWS) and dtypes == [torch.bfloat16, torch.float32]
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_the_kernel_leaves_what_it_does_not_take_to_onednn() -> None:
    layer = packed(60, 32)  # an input width that is not a multiple of 8
    hidden = torch.randn(1, 60)
    with torch.inference_mode():
        got = layer(hidden)  # [1, 32]
    assert layer._packed is not None
    torch.testing.assert_close(got, torch.nn.functional.linear(hidden, layer.weight), rtol=1e-5, atol=1e-5)


def test_no_rows_give_no_outputs() -> None:
    layer = packed(64, 32)
    with torch.inference_mode():  # a forward asked for no logits hands the LM head no rows
        assert layer(torch.randn(1, 0, 64)).shape == (1, 0, 32)


def test_without_a_compiler_one_row_goes_through_onednn(monkeypatch, tmp_path) -> None:
    monkeypatch.setattr("shutil.which", lambda name: None)
    assert load_rows_kernel(tmp_path) is None
    layer = packed()
    assert layer._rows is None
    hidden = torch.randn(1, 64)
    with torch.inference_mode():
        got = layer(hidden)  # [1, V]
    assert layer._packed is not None
    torch.testing.assert_close(got, torch.nn.functional.linear(hidden, layer.weight), rtol=1e-5, atol=1e-5)


def test_a_forward_recording_gradients_keeps_f_linear() -> None:
    layer = packed(bias=True)
    hidden = torch.randn(FP32_ROWS + 1, 64, requires_grad=True)  # wider than the kernel takes
    out = layer(hidden)  # [T, V], autograd on
    out.sum().backward()
    assert layer._packed is None and layer.weight.grad is not None and hidden.grad is not None
    assert torch.equal(out, torch.nn.functional.linear(hidden, layer.weight, layer.bias))


@pytest.mark.parametrize("rows", [BF16_KERNEL_ROWS + 1, BF16_KERNEL_ROWS + 31, 512])
def test_wide_bf16_forwards_take_onednn_packed(rows) -> None:
    """A verify wider than the kernel takes, or a prefill chunk: oneDNN's packed bf16 product (where oneDNN
    has no bf16 kernels its fp32 product over the weight widened), the layer's own outputs up to bf16 rounding."""
    layer = packed(576, 1003, bias=True).to(torch.bfloat16)
    hidden = torch.randn(1, rows, 576).bfloat16()  # [1, T, H]
    with torch.inference_mode():
        got = layer(hidden)  # [1, T, V]
    want = torch.nn.functional.linear(hidden.double(), layer.weight.double(), layer.bias.double())  # [1, T, V]
    assert got.dtype == torch.bfloat16 and layer._packed is not None
    assert layer._packed.dtype == (torch.bfloat16 if onednn_bf16_available() else torch.float32)
    torch.testing.assert_close(got.double(), want, rtol=2**-7, atol=1e-2)


def test_the_packed_weight_follows_an_in_place_update_of_the_weight() -> None:
    layer = packed()
    hidden = torch.randn(FP32_ROWS + 1, 64)  # [T, H], wider than the streaming kernel takes
    with torch.inference_mode():
        before = layer(hidden)  # [T, V], packs the weight
    optimizer = torch.optim.SGD(layer.parameters(), lr=1.0)
    layer(torch.randn(5, 64)).pow(2).mean().backward()
    optimizer.step()  # in place, as training does between evaluations
    with torch.inference_mode():
        after = layer(hidden)  # [T, V]
        layer.weight.mul_(-1.0)  # in place within inference mode, as a test model's logit scale is set
        flipped = layer(hidden)  # [T, V]
    torch.testing.assert_close(after, torch.nn.functional.linear(hidden, layer.weight.neg()), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(flipped, torch.nn.functional.linear(hidden, layer.weight), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(before, after)


def test_a_packed_model_copies_pickles_and_saves_as_plain_linears() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8, bias=False))
    keys = list(model.state_dict())
    assert pack_linears(model) == 2
    hidden = torch.randn(FP32_ROWS + 1, 64)  # [T, H], wider than the streaming kernel takes
    with torch.inference_mode():
        want = model(hidden)  # [T, 8], packs both weights
        buffer = io.BytesIO()
        torch.save(model, buffer)
        buffer.seek(0)
        one = model(hidden[:1])  # [1, 8], the streaming kernel where it was built
        for twin in (copy.deepcopy(model), torch.load(buffer, weights_only=False)):
            torch.testing.assert_close(twin(hidden), want, rtol=1e-5, atol=1e-5)
            assert torch.equal(twin(hidden[:1]), one) and (twin[0]._rows is None) == (model[0]._rows is None)
    assert list(model.state_dict()) == keys


def test_hf_models_pack_their_linears_unless_told_not_to() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from specstack.hf import HFCausalLM

    llama_config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                               num_key_value_heads=1, max_position_embeddings=64)
    module = LlamaForCausalLM(llama_config)
    linears = sum(isinstance(m, torch.nn.Linear) for m in module.modules())
    assert linears == 7 * llama_config.num_hidden_layers + 1  # q, k, v, o, gate, up, down per layer, and the LM head
    model = HFCausalLM(module=module, tokenizer_id=None)
    assert sum(type(m) is PackedLinear for m in model.module.modules()) == linears
    plain = HFCausalLM(module=LlamaForCausalLM(llama_config), tokenizer_id=None, packed_linears=False)
    assert not any(type(m) is PackedLinear for m in plain.module.modules())
