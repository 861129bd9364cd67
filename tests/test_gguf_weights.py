"""Linear weights read in a narrower format (specstack.weight_formats: the GGUF's Q4_1 and Q8_0 blocks, bf16
numbers): the same bits as the weights themselves, in fp32 and (Q4_1) bf16."""

from __future__ import annotations

import platform

import numpy as np
import pytest
import torch

from specstack import native
from specstack.errors import SpecstackError
from specstack.gguf_weights import attach_gguf_blocks, tensor_index
from specstack.packed_linear import PackedLinear, load_rows_kernel, read_bf16_numbers
from specstack.weight_formats import (BF16, GROUP_ROWS, Q4_1, Q4_1_GGUF_BYTES, Q8_0, Q8_0_GGUF_BYTES, bf16_rows, blocks_of, grouped, join_rows,
                                     q4_1_rows, q8_0_rows)

ROWS_KERNEL = load_rows_kernel()
needs_kernel = pytest.mark.skipif(ROWS_KERNEL is None, reason="no C++ compiler here: the few-row kernel cannot be built")
needs_bf16_rows = pytest.mark.skipif(ROWS_KERNEL is None, reason="no C++ compiler here: bf16 rows keep F.linear")
# bf16 products each way the kernel was built for: the way chosen here (specstack.bf16_products), and where it was built
# with bf16 dot products the other way too (widened, or the dot products)
BF16_WAYS = [] if ROWS_KERNEL is None else ROWS_KERNEL.bf16_ways()


def random_blocks(out: int, inp: int, seed: int = 0) -> torch.Tensor:
    """[out, inp / 32 * 24] uint8, as the kernel reads them, from GGUF's Q4_1 blocks with random codes and float16 scales and offsets of the
    sizes a trained layer has (|d| ~ 0.01, |m| ~ 0.1)."""
    rng = np.random.default_rng(seed)
    n = out * inp // 32
    blocks = np.empty((n, Q4_1_GGUF_BYTES), dtype=np.uint8)
    blocks[:, 0:2] = (rng.standard_normal(n) * 0.01).astype(np.float16).view(np.uint8).reshape(n, 2)
    blocks[:, 2:4] = (rng.standard_normal(n) * 0.1).astype(np.float16).view(np.uint8).reshape(n, 2)
    blocks[:, 4:] = rng.integers(0, 256, size=(n, 16), dtype=np.uint8)
    return q4_1_rows(torch.from_numpy(blocks.reshape(out, -1)))


def random_q8_0(out: int, inp: int, seed: int = 0) -> torch.Tensor:
    """[out, inp / 32 * 36] uint8 from GGUF's Q8_0 blocks with random signed codes and float16 scales (|d| ~ 0.001)."""
    rng = np.random.default_rng(seed)
    n = out * inp // 32
    blocks = np.empty((n, Q8_0_GGUF_BYTES), dtype=np.uint8)
    blocks[:, 0:2] = (rng.standard_normal(n) * 0.001).astype(np.float16).view(np.uint8).reshape(n, 2)
    blocks[:, 2:] = rng.integers(0, 256, size=(n, 32), dtype=np.uint8)
    return q8_0_rows(torch.from_numpy(blocks.reshape(out, -1)))


def random_bf16(out: int, inp: int, seed: int = 0) -> torch.Tensor:
    """[out, inp * 2] uint8: random bf16 numbers, as the kernel reads a float32 weight made of them."""
    return torch.randn(out, inp, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16).view(torch.uint8)


STORED = {"q4_1": (Q4_1, random_blocks), "q8_0": (Q8_0, random_q8_0), "bf16": (BF16, random_bf16)}


def bf16_layer(blocks: torch.Tensor, bias: bool, format=Q4_1, kernel=ROWS_KERNEL) -> PackedLinear:
    weight = format.weights(blocks, torch.bfloat16)  # [out, in]
    layer = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=bias, dtype=torch.bfloat16)
    with torch.no_grad():
        layer.weight.copy_(weight)
    PackedLinear.adopt(layer, kernel)
    return layer


@pytest.mark.parametrize("kind, to_rows, format", [("Q4_1", q4_1_rows, Q4_1), ("Q8_0", q8_0_rows, Q8_0)])
def test_blocks_widen_as_the_gguf_reader_widens_them(kind, to_rows, format) -> None:
    gguf = pytest.importorskip("gguf")
    rng = np.random.default_rng(5)
    weights = (rng.standard_normal((6, 96)) * 0.05).astype(np.float32)
    blocks = gguf.quants.quantize(weights, getattr(gguf.GGMLQuantizationType, kind))  # [6, 3 * block bytes]
    theirs = gguf.quants.dequantize(blocks, getattr(gguf.GGMLQuantizationType, kind)).reshape(6, 96)  # [6, 96]
    ours = format.weights(to_rows(torch.from_numpy(blocks)), torch.float32)  # [6, 96]
    assert np.array_equal(ours.numpy().view(np.uint32), theirs.astype(np.float32).view(np.uint32))


def test_stored_rows_lie_in_groups_of_four_each_block_major() -> None:
    """Block b of row i of a group of k rows (four, or what is left) lies at (b * k + i) * block_bytes from the group's
    start, its first row's start; blocks_of undoes it, and join_rows stacks stored matrices whose row counts leave
    short groups (a fused product's q, k and v) as the stored rows of their rows in order."""
    out, count, size = 7, 3, 24
    blocks = torch.arange(out * count * size, dtype=torch.int32).remainder(251).to(torch.uint8).reshape(out, count, size)  # [7, 3, 24]
    stored = grouped(blocks)  # [7, 72]
    assert stored.shape == (out, count * size)
    for r in range(out):
        first = r // GROUP_ROWS * GROUP_ROWS
        k, i = min(GROUP_ROWS, out - first), r - first
        group = stored[first:first + k].reshape(-1)  # the group's bytes
        for b in range(count):
            assert torch.equal(group[(b * k + i) * size:(b * k + i + 1) * size], blocks[r, b]), (r, b)
    assert torch.equal(blocks_of(stored, size), blocks)
    parts = [random_blocks(6, 64, seed=1), random_blocks(3, 64, seed=2), random_blocks(5, 64, seed=3)]
    joined = join_rows(parts, Q4_1)  # [14, 48]
    assert torch.equal(Q4_1.weights(joined, torch.float32), torch.cat([Q4_1.weights(p, torch.float32) for p in parts]))
    assert not torch.equal(joined, torch.cat(parts))  # stacking the stored rows as they lie would mix groups


def fp32_layer(stored: torch.Tensor, format, bias: bool) -> PackedLinear:
    weight = format.weights(stored, torch.float32)  # [out, in]
    layer = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=bias)
    with torch.no_grad():
        layer.weight.copy_(weight)
        if bias:
            layer.bias.copy_(torch.randn(weight.shape[0], generator=torch.Generator().manual_seed(1)))
    PackedLinear.adopt(layer, ROWS_KERNEL)
    return layer


@needs_kernel
@pytest.mark.parametrize("format", sorted(STORED))
@pytest.mark.parametrize("out_features", [8, 10, 1, 40])
@pytest.mark.parametrize("bias", [False, True])
def test_fp32_rows_reading_a_narrower_format_are_the_same_bits_as_rows_reading_the_weight(format, out_features, bias) -> None:
    """Every row count the kernel takes in fp32 (up to six widened in registers, more from a group widened
    into L1), output counts that leave a short last group of four, with a bias."""
    kind, make = STORED[format]
    stored = make(out_features, 160, seed=out_features)
    layer = fp32_layer(stored, kind, bias)
    rows = ROWS_KERNEL.max_rows(torch.float32)
    x = torch.randn(rows, 160, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        for n in range(1, rows + 1):
            plain = layer(x[:n])  # [n, out], the float32 weight
            layer.attach_blocks(stored, kind)
            read = layer(x[:n])  # [n, out], the narrower format
            assert layer._blocks_for is not None, "the stored weight was not read"
            assert torch.equal(read.view(torch.int32), plain.view(torch.int32)), n
            layer._blocks = None


@needs_kernel
@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="an x86 build")
def test_an_avx2_build_reads_every_stored_format_with_the_same_bits(tmp_path, monkeypatch) -> None:
    """The kernel built for AVX2 without AVX-512 (the Zen 3 host's build: bf16 widened to float32 sums) reads each
    stored format, grouped rows included, as the weight it stands for: fp32 rows over Q4_1, Q8_0 and bf16 numbers,
    bf16 rows over Q4_1 and Q8_0 blocks and over the bf16 weight as it lies, short last groups included."""
    monkeypatch.setattr(native, "FLAGS", tuple("-march=x86-64-v3" if flag == "-march=native" else flag for flag in native.FLAGS))
    kernel = load_rows_kernel(tmp_path)
    if kernel is None:
        pytest.skip("the compiler does not build for x86-64-v3")
    assert not kernel.bf16_dots and not kernel.avx512
    for dtype, formats in ((torch.float32, ("q4_1", "q8_0", "bf16")), (torch.bfloat16, ("q4_1", "q8_0"))):
        x = torch.randn(kernel.max_rows(dtype), 160, generator=torch.Generator().manual_seed(2)).to(dtype)  # [rows, 160]
        bits = torch.int32 if dtype == torch.float32 else torch.int16
        for name in formats:
            format, make = STORED[name]
            for out_features in (8, 10, 1):
                stored = make(out_features, 160, seed=out_features)
                weight = format.weights(stored, dtype)  # [out, 160]
                for n in range(1, kernel.max_rows(dtype) + 1):
                    plain = kernel(x[:n], weight, None)  # [n, out], the weight as it lies
                    read = kernel(x[:n], weight, None, stored, format)  # [n, out], the stored rows where the format reads
                    assert torch.equal(read.view(bits), plain.view(bits)), (dtype, name, out_features, n)


@needs_kernel
def test_only_float32_weights_made_of_bf16_numbers_are_read_as_bf16() -> None:
    made_of = torch.nn.Linear(64, 8)
    with torch.no_grad():
        made_of.weight.copy_(made_of.weight.to(torch.bfloat16).float())
    other = torch.nn.Linear(64, 8)
    model = torch.nn.Sequential(made_of, other)
    for layer in model:
        PackedLinear.adopt(layer, ROWS_KERNEL)
    narrow = torch.nn.Linear(48, 8)  # made of bf16 numbers, but rows of 48: the kernel widens 32 at a time
    with torch.no_grad():
        narrow.weight.copy_(narrow.weight.to(torch.bfloat16).float())
    PackedLinear.adopt(narrow, ROWS_KERNEL)
    model.append(narrow)
    assert bf16_rows(other.weight) is None
    assert read_bf16_numbers(model) == 1 and narrow._blocks is None
    x = torch.randn(3, 48)
    with torch.no_grad():
        torch.testing.assert_close(narrow(x), torch.nn.functional.linear(x, narrow.weight, narrow.bias))  # the fp32 weight, read as it is
    assert made_of._format is BF16 and made_of.bytes_per_weight(1) == 2 and other.bytes_per_weight(1) == 4


@needs_bf16_rows
@pytest.mark.parametrize("kernel", BF16_WAYS, ids=lambda kernel: "dots" if kernel.bf16_dots else "widened")
@pytest.mark.parametrize("format", ["q4_1", "q8_0"])
@pytest.mark.parametrize("out_features", [8, 10, 1, 40])
@pytest.mark.parametrize("bias", [False, True])
def test_rows_reading_blocks_are_the_same_bits_as_rows_reading_the_bf16_weight(kernel, format, out_features, bias) -> None:
    """Every row count the kernel takes (on AMX tiles from TILES_FROM rows where there are tiles, which widen
    either kind of block), output counts that leave a short last group of four or of sixteen,
    with a bias; Q4_1 layer matrices and a Q8_0 embedding's LM head; bf16 dot products and widened, where both are built."""
    kind, make = STORED[format]
    layer = bf16_layer(make(out_features, 160, seed=out_features), bias, kind, kernel)
    if bias:
        with torch.no_grad():
            layer.bias.copy_(torch.randn(out_features, generator=torch.Generator().manual_seed(1)))
    rows = kernel.max_rows(torch.bfloat16)
    x = torch.randn(rows, 160, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    with torch.no_grad():
        for n in range(1, rows + 1):
            plain = layer(x[:n])  # [n, out], the bf16 weight
            layer.attach_blocks(make(out_features, 160, seed=out_features), kind)
            read = layer(x[:n])  # [n, out], the blocks
            assert layer._blocks_for is not None, "the blocks were not used"
            assert torch.equal(read.view(torch.int16), plain.view(torch.int16)), n
            layer._blocks = None


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=needs_bf16_rows)])
@needs_kernel
def test_blocks_that_do_not_widen_to_the_weight_are_dropped_and_the_weight_is_read(dtype) -> None:
    layer_of = (lambda blocks: fp32_layer(blocks, Q4_1, bias=False)) if dtype == torch.float32 else (lambda blocks: bf16_layer(blocks, bias=False))
    layer = layer_of(random_blocks(8, 64))
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(3)).to(dtype)
    with torch.no_grad():
        plain = layer(x)  # [2, 8], the weight
        layer.attach_blocks(random_blocks(8, 64, seed=9))  # another matrix's blocks
        assert torch.equal(layer(x), plain)
        assert layer._blocks is None
        layer.attach_blocks(random_blocks(8, 64))
        layer(x)
        assert layer._blocks is not None
        layer.weight.add_(1.0)  # an in-place update: the blocks no longer widen to it
        expected = layer_of(random_blocks(8, 64))
        with torch.no_grad():
            expected.weight.add_(1.0)
        assert torch.equal(layer(x), expected(x)) and layer._blocks is None


@pytest.mark.real_model
@needs_bf16_rows
def test_the_embedded_targets_bf16_forward_reads_every_layer_matrix_as_blocks_with_the_same_logits() -> None:
    """Every q, k, v, o, gate, up and down matrix of the GGUF widens exactly to the bf16 target's weight
    (q and k with their rows back in transformers' order), and so does its Q8_0 embedding to the tied LM head:
    a forward's logits are the same bits from the blocks as from the bf16 weights."""
    from specstack.batch import TokenBatch
    from specstack.models import find_gguf, load_target

    target = load_target(dtype=torch.bfloat16)[0]
    layers = target.module.config.num_hidden_layers
    fused = [layer.qkv.linear for layer in target.decoder.layers] + [layer.gate_up.linear for layer in target.decoder.layers]
    assert sum(m._blocks is not None for m in target.module.modules() if isinstance(m, PackedLinear)) == 7 * layers + 1
    assert all(m._blocks is not None for m in fused) and target.module.lm_head._format is Q8_0
    most = ROWS_KERNEL.max_rows(torch.bfloat16)  # 16 (bf16 dot products or widened), or 32 on AMX tiles
    assert target.linear_bytes_per_weight(1) == target.linear_bytes_per_weight(most) == 0.75  # the floor counts the blocks' bytes
    assert target.linear_bytes_per_weight(most + 1) == 2  # wider products read the bf16 weights (oneDNN)
    assert target.head_bytes_per_weight(1) == target.head_bytes_per_weight(3) == 1.125  # bf16 rows read the Q8_0 blocks
    assert target.head_bytes_per_weight(most) == 1.125 and target.head_bytes_per_weight(most + 1) == 2  # on the tiles too
    tokens = [1, 504, 3458, 314, 253, 1345, 2330, 30]

    def logits() -> torch.Tensor:
        store = target.new_cache(16)
        target.forward(TokenBatch.chain(tokens[:5], start=0, num_logits=1), store)  # a prefill of five
        steps = [target.forward(TokenBatch.chain([t], start=5 + i, num_logits=1), store) for i, t in enumerate(tokens[5:])]  # one row each
        store.truncate(5)
        verify = target.forward(TokenBatch.chain(tokens[5:], start=5, num_logits=3), store)  # three rows (the streaming kernel)
        store.truncate(0)
        wide = target.forward(TokenBatch.chain(tokens, start=0, num_logits=8), store)  # eight rows (the tiles, where there are tiles)
        return torch.cat([*steps, verify, wide])  # [14, V]

    read = logits()
    for m in [*target.module.modules(), *fused]:
        if isinstance(m, PackedLinear):
            m._blocks = None
    assert torch.equal(read.view(torch.int16), logits().view(torch.int16))
    assert attach_gguf_blocks(target.module, find_gguf()) == 7 * layers + 1


@needs_bf16_rows
def test_the_bf16_targets_output_head_rows_read_their_q8_0_blocks_with_the_same_logits() -> None:
    """The rows of the bf16 target's LM head that a Medusa draft vocabulary computes (``output_head``) read those rows'
    Q8_0 blocks, as the whole head reads its own, and give the head's columns bit for bit, read so or not."""
    from specstack.models import load_target

    target = load_target(dtype=torch.bfloat16)[0]
    rows = torch.tensor([7, 0, 49151, 13, 2048, 5, 6, 9, 100])  # not a multiple of the four rows a group holds
    states = torch.randn(3, target.hidden_size, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    part = target.output_head(rows)
    linear = part.__closure__[0].cell_contents
    assert linear._format is Q8_0 and linear._blocks is not None
    read = part(states)  # [3, 9]
    assert torch.equal(read, target.output_logits(states)[:, rows])
    linear._blocks = None
    assert torch.equal(read, part(states))


@pytest.mark.real_model
@needs_bf16_rows
def test_the_bf16_drafts_lm_head_reads_the_targets_q8_0_embedding_with_the_same_logits() -> None:
    """The shipped draft's LM head is the target's embedding rounded to bf16: in bf16 it reads the GGUF's Q8_0
    embedding, the very blocks the target's head reads, and its logits for one, two and three rows are the same bits
    as from its bf16 weight."""
    from specstack.batch import TokenBatch
    from specstack.models import load_default

    target, draft, _ = load_default(dtype=torch.bfloat16)
    head = draft.module.lm_head
    assert head._format is Q8_0 and head._blocks is target.module.lm_head._blocks and draft.head_bytes_per_weight(1) == 1.125
    tokens = [1, 504, 3458, 314, 253, 1345, 2330, 30]

    def logits() -> torch.Tensor:
        store = draft.new_cache(16)
        draft.forward(TokenBatch.chain(tokens[:5], start=0, num_logits=1), store)
        step = draft.forward(TokenBatch.chain(tokens[5:6], start=5, num_logits=1), store)  # [1, V]
        pair = draft.forward(TokenBatch.chain(tokens[6:8], start=6, num_logits=2), store)  # [2, V]
        store.truncate(5)
        three = draft.forward(TokenBatch.chain(tokens[5:8], start=5, num_logits=3), store)  # [3, V]
        return torch.cat([step, pair, three])  # [6, V]

    read = logits()
    head._blocks = None
    assert torch.equal(read.view(torch.int16), logits().view(torch.int16))
    assert draft.read_head_blocks_of(target)
    with torch.no_grad():
        head.weight[0, 0] += 1.0  # a head the blocks no longer widen to
    assert not draft.read_head_blocks_of(target)


@pytest.mark.real_model
@needs_kernel
def test_the_embedded_models_fp32_forwards_read_blocks_and_bf16_numbers_with_the_same_logits() -> None:
    """In fp32 the target reads every layer matrix as Q4_1 blocks and its LM head as the GGUF's Q8_0 embedding,
    and the draft reads its bf16 embedding (its LM head) as bf16: the logits of steps, verifies of three and 16
    tokens (the widest the kernel takes on AVX2) and a 24-token prefill are the same bits as from the fp32 weights."""
    from specstack.batch import TokenBatch
    from specstack.models import find_gguf, load_default

    target, draft, _ = load_default()
    layers = target.module.config.num_hidden_layers
    assert attach_gguf_blocks(target.module, find_gguf()) == 7 * layers + 1  # again: each still widens to its weight
    assert target.module.lm_head._format is Q8_0 and target.head_bytes_per_weight(1) == 1.125 and target.linear_bytes_per_weight(1) == 0.75
    assert draft.module.lm_head._format is BF16 and draft.head_bytes_per_weight(1) == 2
    tokens = [1, 504, 3458, 314, 253, 1345, 2330, 30] * 3

    def logits(model) -> torch.Tensor:
        store = model.new_cache(32)
        model.forward(TokenBatch.chain(tokens[:5], start=0, num_logits=1), store)
        steps = [model.forward(TokenBatch.chain([t], start=5 + i, num_logits=1), store) for i, t in enumerate(tokens[5:8])]  # one row each
        store.truncate(5)
        verify = model.forward(TokenBatch.chain(tokens[5:8], start=5, num_logits=3), store)
        store.truncate(4)
        wide = model.forward(TokenBatch.chain(tokens[4:20], start=4, num_logits=16), store)
        store.truncate(0)
        prefill = model.forward(TokenBatch.chain(tokens, start=0, num_logits=24), store)  # wider than the kernel: oneDNN
        return torch.cat([*steps, verify, wide, prefill])  # [46, V]

    with torch.no_grad():
        for model in (target, draft):
            read = logits(model)
            fused = [layer.qkv.linear for layer in model.decoder.layers] + [layer.gate_up.linear for layer in model.decoder.layers]
            stored = [m for m in [*model.module.modules(), *fused] if isinstance(m, PackedLinear) and m._blocks is not None]
            assert stored
            for m in stored:
                m._blocks = None
            assert torch.equal(read.view(torch.int32), logits(model).view(torch.int32))


@pytest.mark.real_model
def test_the_tensor_index_is_the_gguf_packages() -> None:
    """specstack reads the GGUF's tensor index itself (the gguf package's reader takes seconds over the vocabulary):
    every tensor's name, type, shape and data offset as the package reads them."""
    gguf = pytest.importorskip("gguf")
    from specstack.models import find_gguf

    theirs = {t.name: (int(t.tensor_type), tuple(int(d) for d in reversed(t.shape)), int(t.data_offset)) for t in gguf.GGUFReader(str(find_gguf())).tensors}
    ours = {t.name: (t.kind, t.shape, t.start) for t in tensor_index(find_gguf())}
    assert ours == theirs and len(ours) == 272


def test_a_file_that_is_not_gguf_is_one_error_line(tmp_path) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGML" + bytes(60))
    with pytest.raises(SpecstackError, match="is not a GGUF file of version 2 or 3"):
        tensor_index(path)


@pytest.mark.parametrize("alignment", [32, 64])
def test_the_tensor_index_of_a_written_file_finds_each_tensors_blocks(tmp_path, alignment) -> None:
    """A GGUF written by the gguf package (metadata of every kind before the tensors, a custom alignment):
    each tensor's blocks are read back from where the index says they are."""
    gguf = pytest.importorskip("gguf")
    rng = np.random.default_rng(7)
    weights = {"blk.0.attn_q.weight": (rng.standard_normal((4, 64)) * 0.05).astype(np.float32),
               "token_embd.weight": (rng.standard_normal((3, 96)) * 0.05).astype(np.float32)}
    kinds = {"blk.0.attn_q.weight": gguf.GGMLQuantizationType.Q4_1, "token_embd.weight": gguf.GGMLQuantizationType.Q8_0}
    path = tmp_path / "small.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_custom_alignment(alignment)
    writer.add_string("general.name", "a name of odd length")
    writer.add_array("tokenizer.ggml.tokens", ["a", "bc", "def"])
    writer.add_uint32("llama.block_count", 1)
    writer.add_float32("some.scale", 0.5)
    for name, w in weights.items():
        writer.add_tensor(name, gguf.quants.quantize(w, kinds[name]), raw_dtype=kinds[name])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    index = {t.name: t for t in tensor_index(path)}
    for name, w in weights.items():
        tensor = index[name]
        assert tensor.shape == w.shape and tensor.kind == int(kinds[name])
        stored = tensor.blocks(path).numpy()  # [out, in / 32 * block bytes]
        assert np.array_equal(stored, gguf.quants.quantize(w, kinds[name]))
