"""The linear layers of a model on the CPU: a few input rows through a compiled streaming kernel, more
through oneDNN with a packed copy of each weight.

On the 2-core AVX2 EPYC this project first ran on (torch 2.13, MKL 2024.2, 2 threads), ``F.linear``
in fp32 took two rows at twice the cost of one, and the LM head 2-8 rows at 2.1-2.8x one row, so a
verify of a few tokens cost nearly as much as that many single steps. oneDNN's inner-product primitive
over a weight reordered once into its blocked layout (the kernel inductor uses for frozen CPU linears)
measured, for SmolLM2-135M's 210 layer matrices, 28 / 27 / 33 / 37 / 48 ms for 1 / 2 / 4 / 8 / 16 rows
against ``F.linear``'s 33-39 / 52-56 / 54-59 / 46-50 / 56-61 ms, and for its LM head 5.5 / 6.1 / 7.0 /
8.2 / 11 ms against 10 / 21 / 24 / 25 / 30 ms (docs/benchmarks.md, "The linear layers"). On an Intel
host with AVX-512 that packed kernel took 25-27 ms for one or two rows through the 210 matrices, where
a kernel that only streams the weights once and reuses them for each row (``csrc/linear_rows.cpp``,
built by :mod:`specstack.native`) took 17-20 ms (docs/benchmarks.md, "A few rows: a streaming
kernel"). In bfloat16, where the CPU has AVX-512's bf16 dot products, the same kernel reads bf16
weights without widening them (docs/benchmarks.md, "bf16 linears through vdpbf16ps"); where it has not
(AVX2), or where they do fewer multiply-adds a second than its FMAs (:mod:`specstack.bf16_products`), it widens
bf16 rows and weights to fp32 and sums them as in fp32, rounding each output once (docs/benchmarks.md, "bf16 on
AVX2: a storage format"). Results differ from ``F.linear``'s by rounding only.

This module is the one place that choice is made. :func:`pack_linears` turns a model's ``nn.Linear``
layers into :class:`PackedLinear` (the same module, parameters and state dict, another forward); each
takes up to :data:`MAX_STREAMED_ROWS` rows (sixteen in fp32 and bf16) through the streaming kernel where it was built, packs its weight on its first wider CPU forward without
autograd (fp32, and bf16 where oneDNN has bf16 kernels: there ``F.linear`` reordered the weight on every
call and cost 25-33 ms for 1-16 rows through the target's matrices, the packed kernel 17; where it has none,
bf16 widened to an fp32 copy of the weight, each output rounded once), and keeps
``F.linear`` for every other case (another dtype or device, a forward that records gradients, a build
without oneDNN). Where the CPU has AMX tiles, bf16 products of :data:`TILES_FROM` to :data:`MAX_TILE_ROWS`
rows (verifies of five to 32 tokens) take the kernel's tile path instead of the streaming kernel or
oneDNN, reading the layer's Q4_1 blocks where it has them. A layer can be given its weight in a narrower
format that widens to it bit for bit (:mod:`specstack.weight_formats`: the GGUF's Q4_1 or Q8_0 blocks, or
bf16 numbers held as fp32); the streaming kernel then reads that instead, with the same outputs."""

from __future__ import annotations

import ctypes
from pathlib import Path

import attrs
import torch

from .bf16_products import built_with, dot_products_pay
from .native import SOURCES, CompiledLibrary, load
from .weight_formats import BF16, Q4_1, Q8_0, WeightFormat, bf16_rows

ROWS_SOURCE = SOURCES / "linear_rows.cpp"
# The most input rows the streaming kernel takes, per dtype; wider forwards take oneDNN's packed kernel
# (bf16 too, where oneDNN has bf16 kernels). The streaming kernel sums every output in one order at any of these row
# counts, so a token's outputs are the same bits alone or among up to this many rows.
# fp32: sixteen. On the 2-core AMD Zen 3 host (AVX2) the target's 211 matrices took 30 / 38 / 48 ms for 8 / 12 / 16
# rows through the kernel against oneDNN's packed kernel's 37 / 45 / 52 (docs/benchmarks.md, "Up to sixteen fp32 rows
# on AVX2"). With AVX-512 it had stopped at six, where oneDNN was close over fp32 weights read as they lie (the 2-core
# Intel host: the kernel 1.05-1.11x at 5 and 6 tokens, "Prefetching the weights"); over the GGUF's blocks, which the
# kernel reads at 0.75-1.125 bytes a weight and from seven rows widens into L1 four weight rows at a time, fp32 target
# forwards of 8 / 12 / 16 tokens then took 2.35 / 1.95 / 1.70x less time than with oneDNN over 512 cached slots and
# 1.48 / 1.39 / 1.28x over 7,500 (the Intel host without bf16 dot products; docs/benchmarks.md, "Seven rows or more
# four at a time"). Over plain fp32 weights its 211 matrices took 0.84-0.89x oneDNN's time at 7-9 rows and 1.08-1.15x
# at 12-16.
# bf16 (with AVX-512's bf16 dot products and no AMX tiles): up to 16, the Q4_1 blocks widened once for up to six
# input rows over four weight rows or twelve over two (csrc/linear_rows.cpp, MAX_Q4_ROWS): on the AMD Zen 4 host the
# bf16 target's forwards of 7-16 tokens took 1.02-1.32x less time than with oneDNN's packed kernel when the kernel
# still took passes of six (docs/benchmarks.md, "bf16 verifies in dot products"), and 1.04-1.07x less again at 7 and
# 8 tokens with the pairs.
MAX_STREAMED_ROWS = {torch.float32: 16, torch.bfloat16: 16}
# Where the CPU has no bf16 dot products (AVX2), bf16 products of up to this many rows are widened to fp32 in
# the kernel (csrc/linear_rows.cpp, MAX_WIDENED_BF16_ROWS): there oneDNN has no bf16 kernels and F.linear
# emulates bf16, at 2.3-2.4x the kernel's time for one row through the target's 120 layer products
# (docs/benchmarks.md, "bf16 on AVX2: a storage format"; examples/bf16_widened.py --products). So too where the CPU's
# bf16 dot products do fewer multiply-adds a second than its FMAs (specstack.bf16_products; the Intel host with them:
# the target's 211 products of 1-16 rows over their blocks 1.03-1.71x faster widened).
MAX_WIDENED_BF16_ROWS = 16
# Where the CPU has AMX tiles (``RowsKernel.tiles``), bf16 products of TILES_FROM to MAX_TILE_ROWS rows take
# them instead. The target's 120 layer products of 8-32 rows over their Q4_1 blocks measured 1.47-1.57x
# faster than oneDNN's; whole target forwards over 7,500 cached slots 1.05x (5 tokens) to 1.18x (8, 16)
# faster than with the streaming kernel or oneDNN, and forwards of 3-4 tokens no faster on the tiles
# (docs/benchmarks.md, "Five to 32 rows on AMX tiles"; examples/tile_products.py). From six: on the AMX host of
# 2026-11-30, whole forwards of five tokens took 1.05-1.16x less time without the tiles, of six 1.03-1.06x more
# (docs/benchmarks.md, "Tiles from six rows"). Since the tiles are widened one at a time, forwards of four and five
# tokens take 1.07-1.24x less time on them over 512 slots but 0.99-1.06x over 7,500, and their products then round
# otherwise than a step's: with tiles from four, the nine prompts' lookup stacks wrote autoregressive decoding's text
# in 3 of 18 runs and reached medians of 2.06x / 2.69x, from six in 7 of 18 and 2.64x / 2.85x (docs/benchmarks.md,
# "Tiles widened one at a time"). So a verify of up to five tokens keeps the step's products. Up to 64 rows: from 33 on
# the kernel takes them in two passes of 32 (csrc/linear_rows.cpp, MAX_TILE_PASS_ROWS), each reading the weight, so
# that token trees and chains of 33-64 tokens stay off oneDNN's bf16 weight (docs/benchmarks.md, "Verifies of up to 64
# tokens on the tiles").
TILES_FROM, MAX_TILE_ROWS = 6, 64

PACKED_FOR_ROWS = 4  # the row count oneDNN's reorder is told to expect: measured best over 1-32 rows here (hint 1 doubled 2 rows' cost)


def onednn_available() -> bool:
    """Whether this torch build has the oneDNN linear ops (private to torch, so checked, not assumed)."""
    mkldnn = torch.ops.mkldnn
    return torch.backends.mkldnn.is_available() and hasattr(mkldnn, "_reorder_linear_weight") and hasattr(mkldnn, "_linear_pointwise")


def onednn_bf16_available() -> bool:
    """Whether oneDNN has bf16 kernels on this CPU (AVX-512 with bf16, or AMX); where it has none, a
    packed bf16 product would be emulated and slow, and bf16 keeps ``F.linear``."""
    return onednn_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


@attrs.frozen(kw_only=True)
class RowsKernel(CompiledLibrary):
    """The compiled few-row product ``y_j = W x_j + b`` (``csrc/linear_rows.cpp``) on the CPU, fp32 and
    bf16: bf16 through AVX-512's bf16 dot products where ``bf16_dots``, else widened to fp32. Each output
    is summed in one fixed order, so a row's outputs are the same bits alone or among others."""

    bf16_dots_built: bool = False  # built with AVX-512's bf16 dot products (the CPU has them)
    # bf16 products take vdpbf16ps; else they are widened to fp32. Chosen at load where they pay (specstack.bf16_products);
    # attrs.evolve turns either way on where both are built.
    bf16_dots: bool = attrs.field(default=False, validator=built_with("bf16_dots_built"))
    tiles: bool = False  # bf16 products of up to MAX_TILE_ROWS rows on AMX tiles (the CPU has them and Linux lends them)
    tiles_from: int = TILES_FROM  # the fewest bf16 rows that take the tiles, where there are tiles
    avx512: bool = True  # what the build is: AVX-512 (sixteen-float sums), or False for AVX2 or narrower; no limit depends on it

    @classmethod
    def load_again(cls) -> "RowsKernel | None":
        return load_rows_kernel()

    def bf16_ways(self) -> list["RowsKernel"]:
        """This kernel, and where it was built with bf16 dot products the same kernel taking bf16 the other way (widened,
        or the dot products): what tests and benchmarks compare."""
        return [self, attrs.evolve(self, bf16_dots=not self.bf16_dots)] if self.bf16_dots_built else [self]

    def max_rows(self, dtype: torch.dtype) -> int:
        """The most input rows of ``dtype`` the kernel takes: MAX_STREAMED_ROWS, MAX_TILE_ROWS in bf16 on tiles,
        MAX_WIDENED_BF16_ROWS in bf16 without bf16 dot products."""
        if dtype == torch.bfloat16 and self.tiles:
            return MAX_TILE_ROWS
        return MAX_WIDENED_BF16_ROWS if dtype == torch.bfloat16 and not self.bf16_dots else MAX_STREAMED_ROWS.get(dtype, 0)

    def applies(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
        """Whether ``x`` [..., in], 1 to :meth:`max_rows` float32 or bfloat16 rows on
        the CPU for ``weight`` [out, in], is the kernel's."""
        return x.dtype == weight.dtype and x.device.type == "cpu" and x.numel() % weight.shape[1] == 0 and self.takes(x.numel() // weight.shape[1], weight, bias)

    def takes(self, rows: int, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
        """Whether a product of ``rows`` rows of the weight's dtype through ``weight`` [out, in] on the CPU is the kernel's."""
        dtype, width = weight.dtype, weight.shape[1]
        shape = width % 8 == 0 if dtype == torch.float32 else (dtype == torch.bfloat16 and width % 32 == 0)
        return (shape and 0 < rows <= self.max_rows(dtype) and weight.device.type == "cpu" and weight.is_contiguous()
                and (bias is None or (bias.dtype == dtype and bias.is_contiguous())))

    def entry(self, dtype: torch.dtype, rows: int, weight: torch.Tensor, blocks: torch.Tensor | None, format: WeightFormat) -> tuple:
        """The kernel entry a product of ``rows`` rows of ``dtype`` takes, and what it reads: ``blocks`` (the weight
        stored in ``format``) where given, else ``weight``. bf16 products of ``tiles_from`` rows or more run on the
        tiles where there are tiles."""
        lib = self.library
        stored = blocks is not None and self.reads_stored(dtype, rows, format)
        if dtype == torch.bfloat16 and rows >= self.tiles_from and self.tiles:
            return (getattr(lib, format.tiles_entry), blocks) if stored else (lib.specstack_linear_rows_bf16_tiles, weight)
        widened = "_widened" if dtype == torch.bfloat16 and not self.bf16_dots else ""  # entries every build has
        plain = lib.specstack_linear_rows_f32 if dtype == torch.float32 else getattr(lib, "specstack_linear_rows_bf16" + widened)
        return (getattr(lib, format.entries[dtype] + widened), blocks) if stored else (plain, weight)

    def reads_stored(self, dtype: torch.dtype, rows: int, format: WeightFormat) -> bool:
        """Whether a product of ``rows`` rows of ``dtype`` reads a weight stored in ``format`` rather than the weight
        itself: where the format reads for the dtype, and on the tiles where this build widens the format's tiles (a kernel
        built from an older source may not)."""
        on_tiles = dtype == torch.bfloat16 and rows >= self.tiles_from and self.tiles
        return format.reads(dtype) and (not on_tiles or (format.tiles_entry is not None and hasattr(self.library, format.tiles_entry)))

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, blocks: torch.Tensor | None = None,
                 format: WeightFormat = Q4_1) -> torch.Tensor:
        """x [..., in] -> [..., out], reading ``blocks`` (the weight stored in ``format``, one that reads
        for x's dtype: :mod:`specstack.weight_formats`) instead of the weight where given: the same bits out. bf16 products
        of ``tiles_from`` rows or more run on the tiles where there are tiles (each row's outputs the same bits
        at any of those row counts)."""
        out, inp = weight.shape
        x = x.contiguous()
        y = x.new_empty((*x.shape[:-1], out))  # [..., out]
        n = x.numel() // inp
        entry, stored = self.entry(x.dtype, n, weight, blocks, format)
        status = entry(stored.data_ptr(), x.data_ptr(), None if bias is None else bias.data_ptr(), y.data_ptr(), n, out, inp, torch.get_num_threads())
        if status != 0:
            raise ValueError(f"the few-row linear kernel refused a weight of shape {tuple(weight.shape)}")
        return y


def load_rows_kernel(cache: Path | None = None, source: Path = ROWS_SOURCE) -> RowsKernel | None:
    """The few-row kernel, compiled from ``source`` (default: this checkout's) into ``cache`` (default: the specstack
    cache) on first use; None where it cannot be built here."""
    argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_int]
    loaded = load(source, "specstack_linear_rows_f32", argtypes, cache)
    if loaded is None:
        return None
    library, path = loaded
    widens = hasattr(library, WIDENED_ENTRIES[0])  # every build from this source has them; a kernel built from an older one has none
    tile_entries = [name for name in TILES_ENTRIES if hasattr(library, name)]  # a kernel built from an older source may lack some
    for name in ("specstack_linear_rows_q4_1_f32", "specstack_linear_rows_q8_0_f32", "specstack_linear_rows_bf16_f32", "specstack_linear_rows_bf16",
                 "specstack_linear_rows_q4_1_bf16", "specstack_linear_rows_q8_0_bf16", "specstack_linear_rows_bf16_tiles",
                 *tile_entries, *(WIDENED_ENTRIES if widens else ())):
        entry = getattr(library, name)
        entry.restype, entry.argtypes = ctypes.c_int, argtypes
    built = library.specstack_linear_rows_bf16_dots() == 1
    tiles = built and library.specstack_linear_rows_tiles_supported() == 1
    # the few rows below TILES_FROM go by the rates beside tiles too (the AMX host of 2026-11-30: widened, whole bf16
    # forwards of 2-4 tokens 1.05-1.10x faster over 512 and 7,500 slots)
    dots = built and (not widens or dot_products_pay(built=built, tiles=False, cache=cache))
    return RowsKernel(library=library, path=path, bf16_dots_built=built, bf16_dots=dots, tiles=tiles, avx512=library.specstack_linear_rows_avx512() == 1)


# The entries that widen stored blocks into AMX tiles (WeightFormat.tiles_entry)
TILES_ENTRIES = tuple(format.tiles_entry for format in (Q4_1, Q8_0))
# The bf16 entries widened to fp32 in every build (RowsKernel.entry takes them where bf16_dots is off)
WIDENED_ENTRIES = ("specstack_linear_rows_bf16_widened", "specstack_linear_rows_q4_1_bf16_widened", "specstack_linear_rows_q8_0_bf16_widened")


class PackedLinear(torch.nn.Linear):
    """``nn.Linear`` whose CPU forward without autograd takes a few rows through the streaming kernel
    (fp32 and bf16) and more rows through oneDNN over a packed weight copy (fp32; bf16 where oneDNN has bf16
    kernels, and elsewhere an fp32 copy of the bf16 weight: the rows widened, the fp32 product rounded once to
    bf16; a 2,048-token bf16 prefill chunk 3.7-3.8x faster than through ``F.linear``'s emulated bf16 on the AVX2
    host, at twice the bf16 weight's memory; examples/bf16_widened.py --prefill).

    The copy is remade whenever the weight changes (its storage, which ``.to()`` and ``.data =``
    replace, or its version counter, which an optimizer's in-place step advances), so it is never stale. It is a plain attribute, not a buffer:
    ``state_dict``, ``.to()`` and saving see an ordinary ``nn.Linear``."""

    _packed: torch.Tensor | None
    _packed_from: tuple | None
    _rows: RowsKernel | None  # a few rows; None: where it could not be built
    _bf16_packs: bool  # whether wider bf16 forwards take oneDNN's bf16 kernel (it has bf16 kernels here); else its fp32 one, widened
    _blocks: torch.Tensor | None  # the weight stored narrower [out, in / 32 * block_bytes], read by a few rows instead of it
    _format: WeightFormat  # how _blocks stores it
    _blocks_for: tuple | None  # the weight the blocks were last found to widen to, bit for bit

    def attach_blocks(self, blocks: torch.Tensor, format: WeightFormat = Q4_1, *, checked: bool = False) -> None:
        """Let a few rows read ``blocks`` [out, in / 32 * block_bytes] uint8, the weight stored in ``format``
        (:mod:`specstack.weight_formats`), instead of the weight, for as long as they widen to it bit for bit
        (checked on the next forward, unless the caller just ``checked`` it, and whenever the weight changes),
        where the format reads for the weight's dtype."""
        self._blocks, self._format = blocks.contiguous(), format
        self._blocks_for = self._weight_source(self._parameters["weight"]) if checked else None

    def attach_exact_blocks(self, blocks: torch.Tensor, format: WeightFormat) -> bool:
        """:meth:`attach_blocks` where ``blocks`` (stored in ``format``) widen to the weight bit for bit, on its device,
        and the format reads for its dtype; returns whether they were attached."""
        weight = self._parameters["weight"].detach()
        if not format.reads(weight.dtype) or blocks.device != weight.device or blocks.shape[0] != weight.shape[0]:
            return False
        if not torch.equal(format.weights(blocks, weight.dtype), weight):
            return False
        self.attach_blocks(blocks, format, checked=True)
        return True

    @classmethod
    def adopt(cls, linear: torch.nn.Linear, rows: RowsKernel | None = None) -> None:
        """Give ``linear`` (exactly an ``nn.Linear``) this forward, in place."""
        linear.__class__ = cls
        linear._packed, linear._packed_from, linear._rows = None, None, rows
        linear._blocks, linear._format, linear._blocks_for = None, Q4_1, None
        linear._bf16_packs = onednn_bf16_available()

    def __getstate__(self) -> dict:
        """Copies and pickles leave the packed weight out (oneDNN's layout has no storage to copy)."""
        return {**self.__dict__, "_packed": None, "_packed_from": None, "_blocks_for": None}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] -> [..., out]."""
        params = self._parameters  # read directly: a module's attribute lookup costs more than this call's checks, and a step makes 150-211 of these calls
        weight, bias = params["weight"], params["bias"]
        if self._takes(x, weight):
            if self._rows is not None and self._rows.applies(x, weight, bias):
                return self._rows(x, weight, bias, None if self._blocks is None else self._current_blocks(weight), self._format)  # [..., out]
            if x.dtype == torch.float32 or (x.dtype == torch.bfloat16 and self._bf16_packs):
                return torch.ops.mkldnn._linear_pointwise(x, self._packed_weight(), bias, "none", [], "")  # [..., out]
            if x.dtype == torch.bfloat16:  # oneDNN has no bf16 kernels here: widen, take the fp32 product, round once
                wide_bias = None if bias is None else bias.float()  # [out]
                return torch.ops.mkldnn._linear_pointwise(x.float(), self._packed_weight(), wide_bias, "none", [], "").to(torch.bfloat16)  # [..., out]
        return torch.nn.functional.linear(x, weight, bias)  # [..., out]

    @staticmethod
    def _takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
        """Whether this forward is ours: on the CPU, recording no gradients."""
        return x.device.type == "cpu" and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))

    def rows_product(self, rows: int) -> tuple | None:
        """What a product of ``rows`` rows of the weight's dtype on the CPU takes where the few-row kernel takes it:
        (the kernel entry, the tensor it reads, the bias), the stored weight checked as :meth:`forward` checks it;
        None where the product takes another path."""
        params = self._parameters
        weight, bias = params["weight"], params["bias"]
        if self._rows is None or not self._rows.takes(rows, weight, bias):
            return None
        blocks = None if self._blocks is None else self._current_blocks(weight)
        return (*self._rows.entry(weight.dtype, rows, weight, blocks, self._format), bias)

    def bytes_per_weight(self, rows: int) -> float:
        """Bytes this layer reads per weight in a product of ``rows`` rows: its stored format's where a few
        rows read it (0.75 for Q4_1 blocks), else the weight's element size."""
        weight = self._parameters["weight"]
        if (self._blocks is not None and self._rows is not None and rows <= self._rows.max_rows(weight.dtype)
                and self._rows.reads_stored(weight.dtype, rows, self._format)):
            return self._format.bytes_per_weight
        return weight.element_size()

    def _current_blocks(self, weight: torch.Tensor) -> torch.Tensor | None:
        """The stored weight if it still widens to ``weight`` bit for bit (checked again after any change
        to it; dropped for good where it does not) and its format reads for the weight's dtype (the forward
        asks only where the few-row kernel takes the rows); else None."""
        if not self._format.reads(weight.dtype):
            return None
        source = self._weight_source(weight)
        if self._blocks_for != source:
            if self._blocks.shape[0] != weight.shape[0] or not torch.equal(self._format.weights(self._blocks, weight.dtype), weight.detach()):
                self._blocks = None
                return None
            self._blocks_for = source
        return self._blocks

    @staticmethod
    def _weight_source(weight: torch.Tensor) -> tuple:
        """What changes when the weight does: its storage (new after ``.to()`` or ``.data =``) and its version
        counter (advanced by an in-place write)."""
        return weight.data_ptr(), 0 if weight.is_inference() else weight._version

    def _packed_weight(self) -> torch.Tensor:
        """The weight packed for oneDNN: as it is, or a bf16 weight widened to fp32 where oneDNN has no bf16 kernels."""
        weight = self.weight
        source = self._weight_source(weight)
        if self._packed_from != source:
            widen = weight.dtype == torch.bfloat16 and not self._bf16_packs
            with torch.no_grad():
                self._packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().float() if widen else weight.detach(), PACKED_FOR_ROWS)  # [out, in], oneDNN layout
            self._packed_from = source
        return self._packed


def read_bf16_numbers(module: torch.nn.Module) -> int:
    """Let each fp32 :class:`PackedLinear` of ``module`` on the CPU whose weight is made of bf16 numbers (a
    draft's embedding frozen in bf16, and the LM head tied to it) read them as bf16: the same bits from half
    the bytes (:data:`~specstack.weight_formats.BF16`). Returns how many."""
    taken = 0
    for linear in module.modules():
        weight = linear.weight if isinstance(linear, PackedLinear) else None
        if (weight is not None and linear._blocks is None and weight.dtype == torch.float32 and weight.device.type == "cpu"
                and weight.shape[1] % 32 == 0):  # the kernel widens 32 weights of a row at a time
            rows = bf16_rows(weight)  # [out, in * 2] uint8, or None
            if rows is not None:
                linear.attach_blocks(rows, BF16, checked=True)
                taken += 1
    return taken


def pack_linears(module: torch.nn.Module, *, streamed_rows: bool = True) -> int:
    """Give every ``nn.Linear`` in ``module`` (subclasses left alone) the :class:`PackedLinear`
    forward, in place, a few rows through the streaming kernel where ``streamed_rows`` and it can be
    built; returns how many. Does nothing where oneDNN is missing."""
    if not onednn_available():
        return 0
    kernel = load_rows_kernel() if streamed_rows else None
    linears = [m for m in module.modules() if type(m) is torch.nn.Linear]
    for linear in linears:
        PackedLinear.adopt(linear, kernel)
    return len(linears)
