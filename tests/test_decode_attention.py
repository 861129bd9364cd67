"""The CPU decode-attention kernel (``specstack.decode_attention``): attention of a few new tokens
over a float32 or bfloat16 cache, equal to a float64 reference up to rounding for chains and trees
(a bfloat16 cache widened: bit for bit the float32 kernel on the same numbers; on AMX tiles: up to the
weights' rounding to bf16), taken by a model's forwards exactly where it applies, and absent (SDPA
instead) where it cannot be built."""

from __future__ import annotations

import pickle

import attrs

import pytest
import torch
import torch.nn.functional as F

from specstack.batch import TokenBatch
from specstack.decode_attention import AMX_MIN_KEYS, MAX_TOKENS, MAX_TOKENS_AMX, MAX_TOKENS_DOT_PRODUCTS, MAX_TOKENS_WIDENED_BF16, DecodeKernel, load_decode_kernel
from specstack.native import find_compiler
from specstack.packed_linear import PackedLinear, RowsKernel, load_rows_kernel
from specstack.hf import HFCausalLM
from specstack.kvstore import KVStore
from specstack.testing.llama import random_llama
from specstack.types import Draft, DraftKind

KERNEL = load_decode_kernel()
WIDENING = None if KERNEL is None else attrs.evolve(KERNEL, amx=False, dot_products=False)  # a bfloat16 cache widened to float32, AMX or not
needs_amx = pytest.mark.skipif(KERNEL is None or not KERNEL.amx, reason="no AMX tiles here: a bfloat16 cache is widened")
# the bf16 dot-product paths, where the kernel was built with them, whichever way bf16 goes here (specstack.bf16_products)
DOTS = attrs.evolve(KERNEL, dot_products=True) if KERNEL is not None and KERNEL.dot_products_built else None
needs_dot_products = pytest.mark.skipif(DOTS is None, reason="no AVX-512 bf16 dot products here")
pytestmark = pytest.mark.skipif(find_compiler() is None, reason="no C++ compiler here: the kernel cannot be built")


def test_the_kernel_builds_where_there_is_a_compiler() -> None:
    assert KERNEL is not None, "the C++ compiler is there but the kernel did not build"


def reference(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, sees: torch.Tensor | None) -> torch.Tensor:
    """float64 SDPA with the full [T, n] mask: every cached key, then the new tokens' own under ``sees``."""
    t, n = query.shape[2], key.shape[2]
    mask = torch.ones(t, n, dtype=torch.bool)  # [T, n]
    mask[:, n - t :] = torch.ones(t, t, dtype=torch.bool).tril() if sees is None else sees
    out = F.scaled_dot_product_attention(query.double(), key.double(), value.double(), attn_mask=mask, enable_gqa=True)  # [1, Hq, T, D]
    return out.transpose(1, 2)  # [1, T, Hq, D]


def random_tree_mask(t: int, generator: torch.Generator) -> torch.Tensor:
    """[T, T]: a random token tree's ancestry (each token sees itself and its parent's ancestors)."""
    sees = torch.eye(t, dtype=torch.bool)  # [T, T]
    for i in range(1, t):
        parent = int(torch.randint(-1, i, (1,), generator=generator))
        if parent >= 0:
            sees[i] |= sees[parent]
    return sees


@pytest.mark.parametrize("tree", [False, True])
@pytest.mark.parametrize(("t", "n", "d", "kv_heads", "group"), [
    (1, 7_000, 64, 3, 3),  # the default target's one-token step
    (4, 2_000, 64, 3, 3), (8, 1_000, 64, 3, 3), (16, 900, 64, 3, 3),  # its verifies, up to the widest it takes
    (1, 2, 64, 3, 3),  # one cached key
    (3, 70, 64, 3, 3),  # a cache shorter than a block per thread
    (5, 5, 64, 3, 3),  # nothing cached but the new tokens
    (2, 515, 128, 2, 4),  # a wider head
    (7, 133, 72, 1, 8),  # a head dimension that is not a multiple of 64
    (8, 300, 64, 1, 8),  # 64 query rows, the most it takes
    (2, 200, 64, 3, 3), (4, 3_000, 64, 3, 3), (5, 300, 64, 1, 5),  # 6, 12 and 25 rows: around the column path (6, AVX-512), and where a GEMM took AVX2's rows until 2026-12-01 (25)
    (1, 301, 72, 2, 3), (4, 300, 40, 1, 3),  # few rows (3; 12 as two sixes) over heads whose last 8 columns the wide vectors leave
    (7, 400, 64, 1, 1), (2, 400, 64, 2, 4), (3, 400, 64, 2, 3), (11, 400, 64, 2, 1),  # 7, 8, 9, 11 rows: a six, then a row, a pair, a pair and a row
    (6, 1_500, 64, 1, 3), (10, 500, 64, 1, 2),  # 18 and 20 rows: three sixes, and a pair after them (the few-row path with AVX2)
    (7, 400, 64, 1, 5),  # 35 rows: five sixes, then a five (a pair, a pair and a row with AVX2; the column path's five with AVX-512)
    (9, 300, 80, 1, 3),  # 27 rows of heads of 80: four sixes and a three, the values' last 16 columns eight at a time
    (13, 250, 96, 1, 2),  # 26 rows of heads of 96: four sixes and a pair (AVX2)
])
def test_the_kernel_is_attention_up_to_rounding(t, n, d, kv_heads, group, tree) -> None:
    query, keys, values, sees = attention_inputs(t, n, d, kv_heads, group, tree)
    assert KERNEL.applies(query, keys, values) == (n > t)
    got = KERNEL.attend(query, keys, values, None, sees)  # [1, T, Hq, D]
    want = reference(query, keys, values, sees)  # [1, T, Hq, D]
    assert got.shape == want.shape and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=0, atol=5e-6)


@pytest.mark.parametrize("tree", [False, True])
@pytest.mark.parametrize(("t", "n", "d", "kv_heads", "group"), [
    (1, 7_000, 64, 3, 3), (4, 2_000, 64, 3, 3),  # the default target's step and its widest bf16 verify
    (2, 2_000, 64, 3, 3),  # 6 rows: the few-row path (a six)
    (2, 901, 64, 2, 2), (5, 909, 64, 1, 1), (7, 1_205, 64, 1, 1),  # 4, 5 and 7 rows: pairs, a three and a pair, a six and a row
    (1, 2, 64, 3, 3), (3, 70, 64, 3, 3), (2, 515, 128, 2, 4), (3, 133, 72, 1, 8),
    (3, 1_000, 64, 3, 3), (5, 300, 64, 1, 2), (2, 300, 64, 2, 8),  # 9, 10, 16 rows: a six and a three; a six and two pairs; two sixes and two pairs
    (8, 1_000, 64, 3, 3), (16, 700, 64, 3, 3),  # 24 and 48 rows: four and eight sixes (AVX2)
])
def test_a_bfloat16_cache_is_read_as_its_float32_values(t, n, d, kv_heads, group, tree) -> None:
    """bf16 queries, keys and values, widened (no AMX tiles): the output is the float32 kernel's on the
    same numbers (exactly representable), rounded once to bf16; the kernel reads the bf16 cache in place."""
    query, keys, values, sees = bf16_inputs(t, n, d, kv_heads, group, tree)
    assert WIDENING.applies(query, keys, values) == (n > t)
    got = WIDENING.attend(query, keys, values, None, sees)  # [1, T, Hq, D]
    want = WIDENING.attend(query.float(), keys.float(), values.float(), None, sees)  # [1, T, Hq, D]
    assert got.dtype == torch.bfloat16 and torch.equal(got, want.bfloat16())


@needs_amx
@pytest.mark.parametrize("tree", [False, True])
@pytest.mark.parametrize(("t", "n", "d", "kv_heads", "group"), [
    (1, 7_000, 64, 3, 3), (4, 2_000, 64, 3, 3),  # the default target's step and a verify: one group of rows
    (8, 1_000, 64, 3, 3), (16, 900, 64, 3, 3),  # two and three groups of sixteen rows
    (8, 300, 64, 1, 8),  # 64 rows, four full groups
    (24, 1_000, 64, 3, 3), (40, 301, 64, 3, 3), (64, 2_100, 64, 3, 3),  # verifies and trees of up to 64 tokens: 72-192 rows
    (1, 2, 64, 3, 3), (3, 70, 64, 3, 3),  # one cached key; a cache shorter than a block per thread
    (2, 515, 128, 2, 4), (3, 133, 96, 1, 8),  # wider heads; keys that end mid-block
    (2, 1_000, 64, 3, 3), (1, 133, 96, 2, 4),  # groups of six and four rows: the row-by-row softmax, one ending mid-block
    (1, 1_000, 64, 2, 2), (1, 517, 64, 4, 1), (1, 301, 128, 1, 3),  # three rows or fewer: bf16 dot products, no tiles (one ending mid-pair)
])
def test_a_bfloat16_cache_on_amx_tiles_is_attention_up_to_the_weights_rounding(monkeypatch, t, n, d, kv_heads, group, tree) -> None:
    """On AMX tiles the softmax weights are rounded to bf16 before they weigh the values (as SDPA's bf16
    kernels round them): each output moves by at most 2^-9 of the values' magnitude, then once more
    by its own rounding to bf16. A wrong tile layout, mask or rescale moves it by the values' scale."""
    monkeypatch.setattr("specstack.decode_attention.AMX_MIN_KEYS", 0)  # short caches take the tiles too
    query, keys, values, sees = bf16_inputs(t, n, d, kv_heads, group, tree)
    assert KERNEL.applies(query, keys, values) and KERNEL.tiles(keys.dtype, d, t, n)
    got = KERNEL.attend(query, keys, values, None, sees)  # [1, T, Hq, D]
    want = reference(query, keys, values, sees)  # [1, T, Hq, D], float64
    assert got.dtype == torch.bfloat16
    bound = 2**-8 * want.abs() + 2**-9 * values.abs().amax()  # its own rounding, the weights'
    assert ((got.double() - want).abs() <= bound).all(), float((got.double() - want).abs().max())


DOT_PRODUCT_SHAPES = [
    (1, 7_000, 64, 3, 3),  # the default target's one-token step
    (1, 2, 64, 3, 3), (1, 70, 64, 3, 3),  # one cached key; a cache shorter than a block per thread
    (1, 1_000, 64, 2, 2), (1, 517, 64, 4, 1), (1, 301, 128, 1, 3),  # fewer rows, a wider head, ranges ending mid-pair
    (1, 777, 64, 1, 4), (1, 1_001, 128, 2, 5), (2, 301, 128, 1, 3),  # four to six rows in registers where there are no tiles
    (3, 900, 64, 1, 1),  # three tokens of one query head: three rows under the causal mask
    # seven to fifteen rows in registers, in groups of six or fewer, each over chunks of 1,024 keys in turn
    (2, 7_000, 64, 3, 3), (3, 7_000, 64, 3, 3), (4, 3_000, 64, 3, 3), (5, 2_000, 64, 3, 3),  # the default target's verifies
    (3, 70, 64, 3, 3), (4, 5, 64, 3, 3),  # a cache shorter than a block per thread; nothing cached but the new tokens
    (2, 515, 128, 2, 4), (3, 133, 128, 1, 3), (5, 5_001, 128, 1, 3), (5, 1_001, 64, 1, 3),  # wider heads; ranges ending mid-chunk and mid-pair
    # more rows (a verify), block by block, up to the widest the default target takes
    (6, 7_000, 64, 3, 3), (8, 1_000, 64, 3, 3), (16, 900, 64, 3, 3),
    (8, 300, 64, 1, 8),  # 64 rows, sixteen passes of four
    (6, 70, 64, 3, 3), (6, 7, 64, 3, 3),  # a cache shorter than a block per thread; one cached key
    (4, 515, 128, 1, 4), (7, 133, 128, 1, 3), (7, 1_001, 64, 1, 3),  # wider heads (two rows a pass); ranges ending mid-block and mid-pair
]


@needs_dot_products
@pytest.mark.parametrize(("t", "n", "d", "kv_heads", "group", "tree"),
                         [(*shape, tree) for shape in DOT_PRODUCT_SHAPES for tree in (False, True) if shape[0] > 1 or not tree])  # one token: no tree
def test_bf16_dot_products_are_attention_up_to_the_weights_rounding(t, n, d, kv_heads, group, tree) -> None:
    """A bfloat16 cache takes bf16 dot products where the CPU has them: fifteen query rows or fewer in
    registers (three beside AMX tiles), and more rows block by block where there are no tiles (the kernel told there
    are none, as on an AVX-512 bf16 CPU without AMX). The weights are rounded to bf16 as on the tiles,
    so the same bound holds; told to use neither, the result is the widened one. A wrong layout, mask
    or rescale moves an output by the values' scale."""
    query, keys, values, sees = bf16_inputs(t, n, d, kv_heads, group, tree)
    no_tiles = attrs.evolve(DOTS, amx=False)
    got = no_tiles.attend(query, keys, values, None, sees)  # [1, T, Hq, D]
    want = reference(query, keys, values, sees)  # [1, T, Hq, D], float64
    bound = 2**-8 * want.abs() + 2**-9 * values.abs().amax()  # its own rounding, the weights'
    assert ((got.double() - want).abs() <= bound).all(), float((got.double() - want).abs().max())
    assert not torch.equal(got, WIDENING.attend(query, keys, values, None, sees)) or n - t < 3  # another path than widening (one cached key weighs 1 either way)


@needs_dot_products
@pytest.mark.parametrize(("t", "n", "d"), [(2, 7_000, 64), (3, 7_000, 64), (4, 3_000, 64), (5, 7_000, 64), (2, 515, 64), (3, 1_001, 128), (5, 2_500, 128)])
def test_the_first_token_of_a_verify_of_up_to_five_tokens_gets_the_one_token_steps_bits(t, n, d) -> None:
    """Where there are no tiles, fifteen query rows or fewer take the register path, whose rows do not share
    arithmetic and whose state crosses each chunk of keys exactly: the first token of a verify of up to five tokens
    (up to fifteen rows a KV head, in groups of six or fewer) over n cached keys is the same bits as a one-token
    step over them (the attention; the linear layers give the same bits at any row count, tests/test_gguf_weights.py)."""
    query, keys, values, _ = bf16_inputs(t, n + t, d, 3, 3, False)  # n cached keys and the verify's own t
    no_tiles = attrs.evolve(DOTS, amx=False)
    verify = no_tiles.attend(query, keys, values, None, None)  # [1, t, Hq, D]
    step = no_tiles.attend(query[:, :, :1], keys[:, :, :n + 1], values[:, :, :n + 1], None, None)  # [1, 1, Hq, D]
    assert torch.equal(verify[:, :1], step)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("t", "n", "d"), [(2, 7_000, 64), (3, 7_000, 64), (5, 2_500, 64), (2, 515, 64), (3, 1_001, 72), (4, 300, 40), (5, 1_003, 128)])
def test_on_the_few_row_path_the_first_token_of_a_verify_gets_the_one_token_steps_bits(dtype, t, n, d) -> None:
    """Widened (or float32), up to five tokens of groups of three take the few-row path, whose groupings of rows (sixes,
    threes, pairs, a row; two key-rows to a vector where the head is a multiple of sixteen wide) sum each key-row by one
    tree and accumulate each value column key by key: the first token of a verify over n cached keys is the same bits
    as a one-token step over them. A grouping that sums a row's scores or values in another order fails it."""
    query, keys, values, _ = bf16_inputs(t, n + t, d, 3, 3, False)  # n cached keys and the verify's own t
    query, keys, values = query.to(dtype), keys.to(dtype), values.to(dtype)
    verify = WIDENING.attend_float32(query, keys, values, None, None)  # [1, t, Hq, D], before rounding to bf16
    step = WIDENING.attend_float32(query[:, :, :1], keys[:, :, :n + 1], values[:, :, :n + 1], None, None)  # [1, 1, Hq, D]
    assert torch.equal(verify[:, :1], step)


def use_kernels(target, attention: DecodeKernel, rows: RowsKernel | None) -> None:
    """The target's attention through ``attention`` and its linear layers' rows through ``rows`` (None: as loaded)."""
    target.attention_kernel = attention
    if rows is not None:
        for linear in [m for m in target.module.modules() if isinstance(m, PackedLinear)] + [p.linear for p in target.decoder.products()]:
            linear._rows = rows  # the compiled layers make their plans again from these


@pytest.mark.real_model
@needs_dot_products
def test_the_bf16_targets_verify_of_up_to_five_tokens_gives_its_first_token_the_one_token_steps_logits() -> None:
    """The whole forward, not the attention alone: over 600 cached tokens, the first row of logits of a bf16 verify of
    two to five tokens is the same bits as the one-token step's. Where there are no tiles the attention of up to
    fifteen rows takes the register path, and the linear layers and the LM head (its Q8_0 blocks) give each row the
    same bits at any row count (by the dot products, or on the tiles, which sum a row as they do). Wider verifies may differ."""
    from specstack.models import load_target

    target = load_target(dtype=torch.bfloat16)[0]
    rows = load_rows_kernel()
    tiled = rows is not None and rows.tiles  # the tiles take the five-row products: the few rows then by the dot products, which sum as they do
    use_kernels(target, attrs.evolve(target.attention_kernel, amx=False, dot_products=True), attrs.evolve(rows, bf16_dots=True) if tiled else None)
    generator = torch.Generator().manual_seed(11)
    prompt, verify = torch.randint(1000, 20000, (600,), generator=generator).tolist(), [504, 3458, 314, 253, 1345]
    store = target.new_cache(640)
    target.forward(TokenBatch.chain(prompt, start=0, num_logits=1), store)
    step = target.forward(TokenBatch.chain(verify[:1], start=600, num_logits=1), store)  # [1, V]
    for t in range(2, 6):
        store.truncate(600)
        logits = target.forward(TokenBatch.chain(verify[:t], start=600, num_logits=t), store)  # [t, V]
        assert torch.equal(logits[:1].view(torch.int16), step.view(torch.int16)), t


@pytest.mark.parametrize("tiles", [False, True])
@pytest.mark.parametrize(("t", "d"), [(1, 64), (2, 128), (4, 64), (8, 64), (16, 64)])  # one group, two groups, block by block
def test_scores_that_keep_rising_move_each_rows_reference_and_rescale_its_sums(monkeypatch, tiles, t, d) -> None:
    """A row's weights are taken against a reference that moves up only when a block's scores rise more than e^8
    over it (on AMX tiles: sixteen rows at a time, or against the running maximum where six or fewer are row by
    row). Keys drifting along the cache make each row's scores rise block after block, so the reference moves many
    times over 3,000 keys, and every move must rescale the weight sums and weighted values so far: one that rescaled
    only the sums, or only the values, or not the rows it moved, puts the output far outside the weights' rounding."""
    if DOTS is None or (tiles and not KERNEL.amx):
        pytest.skip("no AMX tiles here" if tiles else "no AVX-512 bf16 dot products here")
    monkeypatch.setattr("specstack.decode_attention.AMX_MIN_KEYS", 0)  # short caches take the tiles too
    kernel = KERNEL if tiles else attrs.evolve(DOTS, amx=False)  # the tiles send one token's three rows to the dot products
    query, keys, values, _ = bf16_inputs(t, 3_000, d, 1, 3, False)
    generator = torch.Generator().manual_seed(7)
    keys = (keys.float() + 0.004 * torch.arange(3_000)[:, None] * torch.randn(d, generator=generator)).bfloat16()  # [1, 1, n, D]
    query = (query.float() + 0.3 * (keys.float()[0, 0, -1] - keys.float()[0, 0, 0])).bfloat16()  # [1, 3, T, D]: the drift raises its scores
    scores = (query.double() @ keys[0, 0, :-t].double().T)[0, 0, 0] * d**-0.5  # [n - t], the first row's
    assert scores[-16:].mean() - scores[:16].mean() > 8 * 10  # the first row's reference moves ten times or more
    got = kernel.attend(query, keys, values, None, None)  # [1, T, Hq, D]
    want = reference(query, keys, values, None)  # [1, T, Hq, D], float64
    bound = 2**-8 * want.abs() + 2**-9 * values.abs().amax()  # its own rounding, the weights'
    assert ((got.double() - want).abs() <= bound).all(), float((got.double() - want).abs().max())


def bf16_inputs(t, n, d, kv_heads, group, tree):
    """``attention_inputs`` in bfloat16."""
    return (x.bfloat16() if x is not None and x.is_floating_point() else x for x in attention_inputs(t, n, d, kv_heads, group, tree))


def attention_inputs(t, n, d, kv_heads, group, tree):
    """query [1, Hq, T, D], keys and values [1, Hkv, n, D] laid out as the store holds them, sees [T, T] or None."""
    generator = torch.Generator().manual_seed(t * 1000 + n)
    capacity = n + 37  # the store's layout: a layer's keys are a strided view of [H, C, D]
    keys = torch.randn(1, kv_heads, capacity, d, generator=generator)[:, :, :n]  # [1, Hkv, n, D]
    values = torch.randn(1, kv_heads, capacity, d, generator=generator)[:, :, :n]  # [1, Hkv, n, D]
    query = 2 * torch.randn(1, kv_heads * group, t, d, generator=generator)  # [1, Hq, T, D]
    sees = random_tree_mask(t, generator) if tree else None  # [T, T]
    return query, keys, values, sees


def test_the_scale_is_the_callers() -> None:
    query, keys, values = torch.randn(1, 4, 2, 16), torch.randn(1, 2, 300, 16), torch.randn(1, 2, 300, 16)
    got = KERNEL.attend(query, keys, values, 0.5, None)  # [1, T, Hq, D]
    want = reference(query * (0.5 * 16**0.5), keys, values, None)  # SDPA's default scale is D^-1/2
    torch.testing.assert_close(got.double(), want, rtol=0, atol=5e-6)


def test_it_applies_only_to_few_tokens_over_a_float32_or_bfloat16_cache() -> None:
    query, keys = torch.randn(1, 9, 2, 64), torch.randn(1, 3, 500, 64)
    assert KERNEL.applies(query, keys, keys)
    assert KERNEL.applies(query.bfloat16(), keys.bfloat16(), keys.bfloat16())
    assert not KERNEL.applies(query.half(), keys.half(), keys.half())  # fp16 stays with SDPA
    assert not KERNEL.applies(query, keys.bfloat16(), keys.bfloat16())  # mixed dtypes too
    for kernel in (KERNEL, WIDENING):
        for dtype in MAX_TOKENS:  # a wide verify or a prefill chunk
            widened_bf16 = dtype == torch.bfloat16 and not kernel.amx and not kernel.dot_products  # no bf16 instructions for SDPA either
            dot_products = dtype == torch.bfloat16 and not kernel.amx and kernel.dot_products
            most = (MAX_TOKENS_AMX if kernel.amx and dtype == torch.bfloat16 else MAX_TOKENS_WIDENED_BF16 if widened_bf16
                    else MAX_TOKENS_DOT_PRODUCTS if dot_products else MAX_TOKENS[dtype])
            assert kernel.max_tokens(dtype, 64) == most
            assert kernel.applies(torch.randn(1, 9, most, 64, dtype=dtype), keys.to(dtype), keys.to(dtype))
            assert not kernel.applies(torch.randn(1, 9, most + 1, 64, dtype=dtype), keys.to(dtype), keys.to(dtype))
    tiled = attrs.evolve(KERNEL, amx=True)
    assert tiled.tiles(torch.bfloat16, 64, 1, AMX_MIN_KEYS) and tiled.tiles(torch.bfloat16, 64, 5, 300)  # a long cache, or many tokens
    assert not tiled.tiles(torch.bfloat16, 64, 4, AMX_MIN_KEYS - 1)  # a few tokens over a short cache: widened
    assert not tiled.tiles(torch.bfloat16, 72, 8, 8000)  # tiles need heads a multiple of 32 wide
    assert not tiled.tiles(torch.float32, 64, 8, 8000)  # and a bfloat16 cache
    assert not KERNEL.applies(torch.randn(1, 9, 500, 64), keys, keys)  # nothing cached: a prefill
    columns = keys.transpose(2, 3).contiguous().transpose(2, 3)  # [1, Hkv, n, D] stored by columns
    assert not KERNEL.applies(query, columns, keys)  # keys not in rows
    assert not KERNEL.applies(query, keys, columns)  # values not in rows
    small = torch.randn(1, 3, 500, 12)
    assert not KERNEL.applies(torch.randn(1, 9, 2, 12), small, small)  # D not a multiple of 8


def test_a_model_forward_takes_the_kernel_and_matches_sdpa(monkeypatch) -> None:
    calls = []
    attend = DecodeKernel.attend
    monkeypatch.setattr(DecodeKernel, "attend", lambda self, *args: calls.append(args[0].shape[2]) or attend(self, *args))
    model = random_llama(layers=2)
    model.decoder.compiled = None  # its layers call the kernel from C (tests/test_compiled_layers.py: the same bits as these calls)
    plain = HFCausalLM(module=model.module, tokenizer_id=model.tokenizer_id, decode_kernel=False)
    assert model.attention_kernel is not None and plain.attention_kernel is None
    prompt = torch.randint(0, 256, (300,), generator=torch.Generator().manual_seed(0)).tolist()
    draft = Draft(tokens=torch.tensor([5, 6, 7, 8]), probs=torch.zeros(4, 256), parents=torch.tensor([-1, -1, 0, 1]), kind=DraftKind.TREE_DETERMINISTIC)
    batches = [lambda: TokenBatch.chain([3], 300, 1), lambda: TokenBatch.chain([3, 4, 9, 1, 2], 300, 5), lambda: TokenBatch.tree([3], 300, draft)]
    for batch in batches:
        logits = []
        for level in (model, plain):
            cache = level.new_cache(320)
            level.forward(TokenBatch.chain(prompt, 0, 1), cache)
            logits.append(level.forward(batch(), cache))  # [num_logits, V]
        torch.testing.assert_close(logits[0], logits[1], rtol=1e-4, atol=1e-4)
    assert calls == [1, 1, 5, 5, 5, 5]  # two layers each: the chains and the tree; never the prefills or the plain model


def test_a_pickled_kernel_loads_again() -> None:
    copy = pickle.loads(pickle.dumps(KERNEL))
    assert isinstance(copy, DecodeKernel) and copy.path == KERNEL.path


def test_without_a_compiler_there_is_no_kernel_and_forwards_use_sdpa(monkeypatch, tmp_path) -> None:
    monkeypatch.setattr("shutil.which", lambda name: None)
    assert load_decode_kernel(tmp_path) is None
    model = random_llama(layers=1)
    assert model.attention_kernel is None
    cache = model.new_cache(40)
    model.forward(TokenBatch.chain(list(range(30)), 0, 1), cache)
    assert model.forward(TokenBatch.chain([1, 2], 30, 2), cache).shape == (2, 256)


def test_prepare_builds_the_kernels_and_says_where(monkeypatch, capsys) -> None:
    from specstack import cli, models

    monkeypatch.setattr(models, "prepare_target", lambda: "the-target")  # the weights are not this test's
    assert cli.main(["prepare"]) == 0
    out = capsys.readouterr().out
    assert f"decode-attention kernel built at {KERNEL.path}" in out and "few-row linear kernel built at " in out


def test_a_cache_that_cannot_be_written_leaves_no_kernel(tmp_path) -> None:
    blocked = tmp_path / "cache"
    blocked.write_text("a file where the cache directory should be\n")
    assert load_decode_kernel(blocked) is None


def test_a_failed_build_leaves_no_kernel(monkeypatch, tmp_path) -> None:
    broken = tmp_path / "broken.cpp"
    broken.write_text("this is not C++\n")
    monkeypatch.setattr("specstack.decode_attention.SOURCE", broken)
    assert load_decode_kernel(tmp_path) is None
    assert not list((tmp_path / "kernels").glob("*.so"))


def column_store(dtype, capacity=1024):
    """A one-layer KV store of three KV heads of 64 with random keys and values in every slot, slot i at position i."""
    store = KVStore(layers=1, kv_heads=3, head_dim=64, capacity=capacity, dtype=dtype)
    store.slot_positions[:] = torch.arange(capacity)
    refill(store, 0, capacity, seed=0)
    return store


def refill(store, first, last, seed):
    """New random keys and values in slots first .. last - 1 of the store's one layer."""
    generator = torch.Generator().manual_seed(seed)
    for buffer in (store.keys, store.values):
        buffer[0, :, first:last] = torch.randn(3, last - first, 64, generator=generator).to(buffer.dtype)


def attend_over_store(store, n, t, seed):
    """t new tokens over the store's n slots (the last t their own; n - t cached), with the store's keys by columns,
    and the same without them (the keys copied out of the store, so the kernel lays out every group as it reads it)."""
    store.length = n - t
    query = torch.randn(1, 9, t, 64, generator=torch.Generator().manual_seed(seed)).to(store.keys.dtype)  # [1, Hq, T, D]
    key, value = store.keys[0, :, :n][None], store.values[0, :, :n][None]  # [1, Hkv, n, D], the store's own buffers
    with_columns = KERNEL.attend_float32(query, key, value, None, None, store, 0)  # [1, T, Hq, D]
    without = KERNEL.attend_float32(query, key.clone(), value.clone(), None, None)
    return with_columns, without


needs_column_keys = pytest.mark.skipif(KERNEL is None or not KERNEL.column_keys(torch.float32, 64, 6), reason="no column path here (AVX-512 only)")


@needs_column_keys
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_store_keeps_its_keys_by_columns_and_they_give_the_same_bits(dtype) -> None:
    """The kernel reads a store's groups of keys below its mark and lays out and keeps the others: as the store grows,
    the mark follows the whole groups of cached keys, and the output is the same bits as laying out every group. A width
    whose rows do not read the groups (one token on the widening paths: the few-row path) leaves the mark where it was.
    With bf16 dot products every width reads them: up to five tokens in registers, more a block of 64 keys at a time
    (on two threads the ranges over 900 cached keys meet at 448, inside a block's four groups), whatever the threads."""
    if not KERNEL.column_keys(dtype, 64, 6):
        pytest.skip(f"a {dtype} cache does not take the column path here")
    threads = torch.get_num_threads()
    try:
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            store = column_store(dtype, capacity=1024)
            mark = 0
            for n, t in [(700, 2), (703, 3), (720, 1), (721, 2), (900, 5), (908, 8), (1000, 16), (1010, 6), (1020, 1)]:
                with_columns, without = attend_over_store(store, n, t, seed=n)
                assert torch.equal(with_columns, without), (n, t)
                if KERNEL.column_keys(dtype, 64, 3 * t):
                    mark = (n - t) - (n - t) % 16
                assert int(store.columns_upto[0]) == mark, (n, t)
    finally:
        torch.set_num_threads(threads)


@needs_column_keys
@pytest.mark.parametrize("change", ["truncate", "keep", "gather", "copy"])
def test_a_store_that_changes_its_keys_below_the_mark_lowers_it(change) -> None:
    """Rolling back and writing other keys, compacting (eviction) and gathering all change keys in slots whose groups the
    store keeps: it lowers the mark, so the kernel lays them out again instead of reading stale groups (a store that
    kept its mark would give other bits here). A bf16 cache where it keeps its keys by columns, else (bf16 dot products
    take it) a float32 one."""
    dtype = torch.bfloat16 if KERNEL.column_keys(torch.bfloat16, 64, 6) else torch.float32
    store = column_store(dtype)
    attend_over_store(store, 900, 2, seed=1)  # groups current up to 896
    if change == "truncate":  # a rejected draft: back to 600, then other keys there
        store.truncate(600)
        assert int(store.columns_upto[0]) == 592
        refill(store, 600, 900, seed=2)
    elif change == "keep":  # eviction: sinks stay, later slots move to the front
        store.keep(torch.cat([torch.arange(4), torch.arange(300, 898)]))
        assert int(store.columns_upto[0]) == 0
    elif change == "gather":  # a retrieval view refilled from another store
        store.gather_from(column_store(dtype), torch.arange(100, 990), horizon=990)
        store.slot_positions[:] = torch.arange(store.capacity)
    else:
        source = column_store(dtype)
        refill(source, 0, 1024, seed=3)
        source.length = 899
        store.copy_prefix(source, 899)
    assert int(store.columns_upto[0]) == 0 or change == "truncate"
    with_columns, without = attend_over_store(store, 900, 2, seed=4)
    assert torch.equal(with_columns, without)


@needs_column_keys
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("t", "n"), [(2, 7_000), (3, 1_001), (6, 2_500), (8, 515), (11, 3_003), (16, 7_000)])
def test_on_the_column_path_the_first_token_of_a_verify_gets_the_one_token_steps_bits(dtype, t, n) -> None:
    """Verifies take the keys by columns and the few-row path's weighted values at any width, the one-token step the
    few-row path: each key-row is summed by the same tree either way (the last keys of a block too, as a four padded
    with zero keys), so the first token of a verify of up to sixteen tokens is the same bits as the step, from a store's
    keys by columns or laid out as they are read. With bf16 dot products a bf16 verify of up to five tokens (fifteen
    rows) takes the register path, as the step does, each row summed alike; a wider one sums its blocks in another
    order (csrc/decode_attention.cpp, "More rows"), so there it is not asked."""
    if dtype == torch.bfloat16 and KERNEL.dot_products and 3 * t > 15:
        pytest.skip("bf16 dot products: a verify of more than five tokens sums block by block, in another order than the step")
    if KERNEL.tiles(dtype, 64, t, n):
        pytest.skip("AMX tiles: a bf16 verify over this many keys sums on the tiles, in another order than the step")
    store = column_store(dtype, capacity=n + t)
    query = torch.randn(1, 9, t, 64, generator=torch.Generator().manual_seed(t)).to(dtype)  # [1, Hq, T, D]
    key, value = store.keys[0, :, : n + t][None], store.values[0, :, : n + t][None]  # [1, Hkv, n + T, D]
    step = KERNEL.attend_float32(query[:, :, :1], key[:, :, : n + 1].clone(), value[:, :, : n + 1].clone(), None, None)  # [1, 1, Hq, D]
    store.length = n
    for held in (None, store, store):  # laid out as read; from the store, laying out and keeping; from the store's groups
        verify = KERNEL.attend_float32(query, key, value, None, None, held, 0)  # [1, T, Hq, D]
        assert torch.equal(verify[:, :1], step)


@pytest.mark.real_model
@needs_column_keys
def test_on_the_column_path_the_bf16_targets_verify_gives_its_first_token_the_one_token_steps_logits() -> None:
    """The whole forward on a CPU without bf16 dot products: over 600 cached tokens, the first row of logits of a bf16
    verify of two to sixteen tokens (the keys by columns, the store keeping them) is the same bits as the one-token
    step's, since the linear layers and the LM head give each row the same bits at any row count up to sixteen."""
    if KERNEL.dot_products:
        pytest.skip("bf16 dot products here: bf16 verifies of more than five tokens sum in another order than the step")
    from specstack.models import load_target

    target = load_target(dtype=torch.bfloat16)[0]
    generator = torch.Generator().manual_seed(12)
    prompt, verify = torch.randint(1000, 20000, (600,), generator=generator).tolist(), torch.randint(1000, 20000, (16,), generator=generator).tolist()
    store = target.new_cache(640)
    target.forward(TokenBatch.chain(prompt, start=0, num_logits=1), store)
    step = target.forward(TokenBatch.chain(verify[:1], start=600, num_logits=1), store)  # [1, V]
    for t in (2, 3, 5, 8, 12, 16):
        store.truncate(600)
        logits = target.forward(TokenBatch.chain(verify[:t], start=600, num_logits=t), store)  # [t, V]
        assert torch.equal(logits[:1].view(torch.int16), step.view(torch.int16)), t
    assert int(store.columns_upto.min()) == 592  # every layer's groups of the 600 cached keys kept


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("t", "n"), [(2, 70), (3, 255), (5, 256), (8, 257), (16, 1_001), (4, 2), (16, 7_000), (11, 511)])
def test_on_the_widening_paths_every_token_of_a_chain_verify_gets_the_steps_bits(dtype, t, n) -> None:
    """The widening paths cut every head's keys, the new tokens' included, into spans fixed from key 0 and merge a row's
    spans in order, so each token of a chain verify over n cached keys is the same bits as the one-token step at its
    position (n + i keys cached, its own last), whatever the threads: from the keys as stored, and from a store's keys by
    columns. Spans cut where the threads' shares fall, or the own keys folded in at the merge, fail it from the second
    token on (cases across a span's end: 255-257 keys)."""
    store = column_store(dtype, capacity=n + t)
    key, value = store.keys[0, :, : n + t][None], store.values[0, :, : n + t][None]  # [1, Hkv, n + T, D]
    query = torch.randn(1, 9, t, 64, generator=torch.Generator().manual_seed(t)).to(dtype)  # [1, Hq, T, D]
    threads = torch.get_num_threads()
    try:
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            store.length = n
            for held in (None, store):  # laid out as read; from the store
                verify = WIDENING.attend_float32(query, key, value, None, None, held, 0)  # [1, T, Hq, D]
                for i in range(t):
                    step = WIDENING.attend_float32(query[:, :, i : i + 1], key[:, :, : n + i + 1].clone(), value[:, :, : n + i + 1].clone(), None, None)
                    assert torch.equal(verify[:, i : i + 1], step), (count, held is not None, i)
    finally:
        torch.set_num_threads(threads)


def random_tree(t: int, seed: int) -> torch.Tensor:
    """[t, t] bool: which of t new tokens each sees, for the last committed token (token 0) and a tree of t - 1 nodes under
    it, each node's parent drawn from the tokens before it; every token sees its ancestors and itself."""
    generator = torch.Generator().manual_seed(seed)
    sees = torch.zeros(t, t, dtype=torch.bool)
    sees[0, 0] = True
    for i in range(1, t):
        sees[i] = sees[int(torch.randint(i, (1,), generator=generator))]
        sees[i, i] = True
    return sees


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("t", "n"), [(3, 70), (8, 60), (5, 256), (16, 250), (12, 1_020), (16, 7_030), (11, 508), (2, 64), (6, 126)])
def test_on_the_widening_paths_every_token_of_a_tree_verify_gets_the_steps_bits(dtype, t, n) -> None:
    """A tree's token sees the cached keys and its path (its ancestors, then itself), which its one-token step holds in a
    row of slots; here the tree's other nodes lie between them. Each token's keys from the block where the new tokens'
    begin are gathered as its step holds them, so each token of a tree verify over n cached keys is the same bits as the
    step over the cached keys and its path, whatever the threads: from the keys as stored, and from a store's keys by
    columns. Folding the tree's own keys under the mask in the shared blocks fails it where its nodes cross a block's or a
    span's end."""
    store = column_store(dtype, capacity=n + t)
    key, value = store.keys[0, :, : n + t][None], store.values[0, :, : n + t][None]  # [1, Hkv, n + T, D]
    query = torch.randn(1, 9, t, 64, generator=torch.Generator().manual_seed(t)).to(dtype)  # [1, Hq, T, D]
    sees = random_tree(t, seed=n)
    threads = torch.get_num_threads()
    try:
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            for held in (None, store):  # laid out as read; from the store
                store.length, store.columns_upto[:] = n, 0
                verify = WIDENING.attend_float32(query, key, value, None, sees, held, 0)  # [1, T, Hq, D]
                for u in range(t):
                    path = n + torch.nonzero(sees[u]).flatten()  # the slots of its ancestors and itself, in order
                    keys, values = (torch.cat([x[:, :, :n], x[:, :, path]], dim=2) for x in (key, value))  # [1, Hkv, n + depth + 1, D]
                    step = WIDENING.attend_float32(query[:, :, u : u + 1], keys, values, None, None)
                    assert torch.equal(verify[:, u : u + 1], step), (count, held is not None, u)
                if held is not None:
                    assert int(store.columns_upto[0]) <= n - n % 16  # only groups it read, or laid out and kept
    finally:
        torch.set_num_threads(threads)


@pytest.mark.real_model
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_on_the_widening_paths_every_token_of_a_verify_gets_the_steps_logits(dtype) -> None:
    """The whole forward: over 600 cached tokens, each row of logits of a chain verify of two to sixteen tokens is the
    same bits as the one-token steps' that feed the same tokens one by one, in fp32 and bf16, since the linear layers,
    the LM head and the decoder's small operations give a row the same bits at any row count, and the widening paths'
    attention does (above). So a greedy chain stack writes exactly what autoregressive decoding writes."""
    from specstack.models import load_target

    target = load_target(dtype=dtype)[0]
    target.widen_bf16_products()
    generator = torch.Generator().manual_seed(13)
    prompt, verify = torch.randint(1000, 20000, (600,), generator=generator).tolist(), torch.randint(1000, 20000, (16,), generator=generator).tolist()
    store = target.new_cache(640)
    target.forward(TokenBatch.chain(prompt, start=0, num_logits=1), store)
    steps = torch.cat([target.forward(TokenBatch.chain(verify[i : i + 1], start=600 + i, num_logits=1), store) for i in range(16)])  # [16, V]
    for t in (2, 3, 5, 8, 12, 16):
        store.truncate(600)
        logits = target.forward(TokenBatch.chain(verify[:t], start=600, num_logits=t), store)  # [t, V]
        bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
        assert torch.equal(logits.view(bits), steps[:t].view(bits)), t


@pytest.mark.real_model
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_on_the_widening_paths_every_node_of_a_tree_verify_gets_the_steps_logits(dtype) -> None:
    """The whole forward of a token tree: over 252 cached tokens (its nodes across a span's end), each row of logits of a
    verify of the last committed token and a tree of 15 nodes under it is the same bits as the one-token step that feeds
    the node's path (the committed token, its ancestors, itself) one by one, in fp32 and bf16. So a greedy tree stack
    writes exactly what autoregressive decoding writes. The tree's own keys folded under the mask in the blocks the rows
    share (its nodes in other blocks and spans than their steps') fail it, in bf16 at nodes 4, 8, 9 and 13."""
    from specstack.models import load_target

    target = load_target(dtype=dtype)[0]
    target.widen_bf16_products()
    generator = torch.Generator().manual_seed(14)
    prompt, tokens = torch.randint(1000, 20000, (252,), generator=generator).tolist(), torch.randint(1000, 20000, (16,), generator=generator).tolist()
    parents = [-1, -1, 0, 0, 1, 2, 2, 3, 4, 4, 5, 7, 7, 8, 11]  # node i's parent among the nodes (-1: the committed token)
    draft = Draft(tokens=torch.tensor(tokens[1:]), probs=torch.zeros(15, target.vocab_size), parents=torch.tensor(parents),
                  kind=DraftKind.TREE_DETERMINISTIC)
    store = target.new_cache(300)
    target.forward(TokenBatch.chain(prompt, start=0, num_logits=1), store)
    tree = target.forward(TokenBatch.tree(tokens[:1], 252, draft), store)  # [16, V]: the committed token's row, then the nodes'
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    for node in range(-1, 15):
        path = [node]
        while path[-1] >= 0:
            path.append(parents[path[-1]])
        store.truncate(252)
        for depth, i in enumerate(reversed(path)):  # -1 (the committed token) first
            step = target.forward(TokenBatch.chain([tokens[i + 1]], start=252 + depth, num_logits=1), store)  # [1, V]
        assert torch.equal(tree[node + 1 : node + 2].view(bits), step.view(bits)), node
