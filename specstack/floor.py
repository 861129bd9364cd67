"""The floor of a forward pass: what this machine cannot do faster (a roofline).

A forward of T new tokens over a KV view of n cached slots must at least read every weight it uses
once and the cached keys and values once, and at least do the multiply-adds of its matrix products:

    bytes = b · P_linear + h · P_head + e · P_embed + e · 2 · n · L · H_kv · D
    flops = 2 · P_linear · T + 2 · 2 · T · n · H_q · D · L + 2 · r · V · d

with e the element size of the dtype (4 for float32, 2 for bfloat16), b the bytes the linear maps read
per weight (e, or 0.75 where a few rows read the GGUF's Q4_1 blocks: specstack.weight_formats), h the bytes the
LM head reads per weight (e, or 1.125 where a few fp32 rows read a Q8_0 embedding), L layers, d the hidden size,
H_q / H_kv the query and KV heads of width D, V the vocabulary, r the logits rows computed,
P_linear the parameters of every layer's linear maps (q, k, v, o, gate, up, down),
P_head = V · d when logits are computed (r > 0), and P_embed = T · d, the embedding rows of the T
tokens, unless the embedding is tied to a head that is read anyway. The attention term is QKᵀ and
PV over the cached slots; norms, rotary embeddings, softmax and the T × T attention among the new
tokens are left out (well under 1% at the shapes measured here). The floor is

    seconds = max(bytes / read bandwidth, flops / GEMM peak of the dtype)

with the machine's measured read bandwidth and attainable matrix-product throughput
(:func:`measure_machine`). :func:`forward_floor` is the one place this is computed; ``specstack
floor`` (:mod:`specstack.bench.floor`) reports each measured forward as a ratio to it.
"""

from __future__ import annotations

import time
from typing import Callable, Mapping, Sequence

import attrs
import torch

from .errors import SpecstackError
from .packed_linear import pack_linears

ELEMENT_BYTES = {"float32": 4, "bfloat16": 2}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def dtype_name(dtype: torch.dtype | str) -> str:
    """``"float32"`` or ``"bfloat16"`` for a torch dtype or its name; anything else is one error line."""
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise SpecstackError(f"unknown dtype {name!r}; available: {', '.join(sorted(DTYPES))}")
    return name


def _positive(instance, attribute, value: int) -> None:
    if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
        raise SpecstackError(f"{attribute.name} {value!r} is not allowed; use an integer >= 1")


@attrs.frozen(kw_only=True)
class ModelShape:
    """What the floor needs of a Llama-family model."""

    layers: int = attrs.field(validator=_positive)
    hidden: int = attrs.field(validator=_positive)
    intermediate: int = attrs.field(validator=_positive)
    heads: int = attrs.field(validator=_positive)
    kv_heads: int = attrs.field(validator=_positive)
    head_dim: int = attrs.field(validator=_positive)
    vocab: int = attrs.field(validator=_positive)
    tied: bool

    @classmethod
    def from_config(cls, config) -> "ModelShape":
        """From a transformers ``LlamaConfig`` (or any config with the same field names)."""
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(layers=config.num_hidden_layers, hidden=config.hidden_size, intermediate=config.intermediate_size,
                   heads=config.num_attention_heads, kv_heads=config.num_key_value_heads, head_dim=head_dim,
                   vocab=config.vocab_size, tied=bool(getattr(config, "tie_word_embeddings", False)))

    @property
    def linear_params(self) -> int:
        """Parameters of every layer's linear maps: q, k, v, o, then gate, up, down."""
        attention = self.hidden * (self.heads + 2 * self.kv_heads) * self.head_dim + self.heads * self.head_dim * self.hidden
        return self.layers * (attention + 3 * self.hidden * self.intermediate)

    @property
    def head_params(self) -> int:
        return self.vocab * self.hidden

    def kv_elements(self, cached: int) -> int:
        """Numbers a KV cache of ``cached`` slots holds: keys and values of every layer and KV head."""
        return 2 * cached * self.layers * self.kv_heads * self.head_dim

    def linear_shapes(self) -> list[tuple[int, int]]:
        """(in, out) of one layer's linear maps, in the order a layer runs them."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return [(self.hidden, q), (self.hidden, kv), (self.hidden, kv), (q, self.hidden),
                (self.hidden, self.intermediate), (self.hidden, self.intermediate), (self.intermediate, self.hidden)]


@attrs.frozen(kw_only=True)
class Gemm:
    """One measured matrix product: ``rows`` × the weights ``(in, out)`` pairs of ``what``."""

    dtype: str
    what: str  # "layer" (one layer's linear maps), "lm head" or "square N"
    rows: int
    flops_per_s: float


@attrs.frozen(kw_only=True)
class Machine:
    """This machine's roofs at ``threads`` torch threads: read bandwidth (bytes/s) and the best
    matrix-product throughput measured per dtype (flop/s); ``gemm`` holds every measurement."""

    threads: int
    read_bandwidth: float
    gemm_peak: dict[str, float]
    bandwidth_mib: int = 0
    gemm: tuple[Gemm, ...] = ()
    cpu_capability: str = ""  # torch's vector kernels (torch.backends.cpu.get_cpu_capability())
    onednn_bf16: bool | None = None  # whether bf16 matrix products may use oneDNN's bf16 kernels
    bf16_products: str = ""  # the bf16 dot products' and FMAs' rates a core, and the way bf16 products go (specstack.bf16_products)

    def peak(self, dtype: torch.dtype | str) -> float:
        """The attainable flop/s of ``dtype``'s products. A bf16 product can always be taken as the fp32 product
        of its numbers widened (exact products; the kernels do so on CPUs without bf16 dot products), so
        bf16's is at least fp32's where both were measured: a slow emulated bf16 GEMM does not lower the floor."""
        name = dtype_name(dtype)
        if name not in self.gemm_peak:
            raise SpecstackError(f"no GEMM throughput was measured for {name}; measured: {', '.join(sorted(self.gemm_peak))}")
        if name == "bfloat16" and "float32" in self.gemm_peak:
            return max(self.gemm_peak[name], self.gemm_peak["float32"])
        return self.gemm_peak[name]

    def as_dict(self) -> dict:
        return {"threads": self.threads, "cpu_capability": self.cpu_capability, "onednn_bf16": self.onednn_bf16, "bf16_products": self.bf16_products,
                "read_bandwidth_gb_s": self.read_bandwidth / 1e9, "bandwidth_buffer_mib": self.bandwidth_mib,
                "gemm_peak_gflop_s": {k: v / 1e9 for k, v in self.gemm_peak.items()},
                "gemm": [{"dtype": g.dtype, "what": g.what, "rows": g.rows, "gflop_s": g.flops_per_s / 1e9} for g in self.gemm]}


@attrs.frozen(kw_only=True)
class Floor:
    """The floor of one forward: its bytes and flops, and the seconds each takes at the machine's roofs."""

    bytes: float
    flops: float
    memory_s: float
    compute_s: float

    @property
    def seconds(self) -> float:
        return max(self.memory_s, self.compute_s)

    @property
    def bound(self) -> str:
        return "memory" if self.memory_s >= self.compute_s else "compute"

    def as_dict(self) -> dict:
        return {"bytes": self.bytes, "flops": self.flops, "memory_ms": 1e3 * self.memory_s, "compute_ms": 1e3 * self.compute_s,
                "floor_ms": 1e3 * self.seconds, "bound": self.bound}


def forward_floor(shape: ModelShape, dtype: torch.dtype | str, tokens: int, cached: int, logits_rows: int, machine: Machine,
                  linear_bytes: float | None = None, head_bytes: float | None = None) -> Floor:
    """The floor of a forward of ``tokens`` new tokens over ``cached`` KV slots returning
    ``logits_rows`` rows of logits, its linear maps reading ``linear_bytes`` per weight and its LM head
    ``head_bytes`` (default, each: the dtype's element size); the module docstring has the formula."""
    if not (isinstance(tokens, int) and tokens >= 1):
        raise SpecstackError(f"tokens {tokens!r} is not allowed; use an integer >= 1")
    if not (isinstance(cached, int) and cached >= 0):
        raise SpecstackError(f"cached {cached!r} is not allowed; use an integer >= 0")
    if not (isinstance(logits_rows, int) and 0 <= logits_rows <= tokens):
        raise SpecstackError(f"logits_rows {logits_rows!r} is not allowed; use an integer from 0 to tokens ({tokens})")
    e = ELEMENT_BYTES[dtype_name(dtype)]
    head = shape.head_params if logits_rows else 0
    embed = 0 if (shape.tied and logits_rows) else tokens * shape.hidden  # tied: those rows are in the head, read anyway
    kv = shape.kv_elements(cached)
    for name, value in (("linear_bytes", linear_bytes), ("head_bytes", head_bytes)):
        if value is not None and not value > 0:
            raise SpecstackError(f"{name} {value!r} is not allowed; use a number of bytes per weight > 0")
    weights_bytes = ((e if linear_bytes is None else linear_bytes) * shape.linear_params + (e if head_bytes is None else head_bytes) * head
                     + e * embed)
    flops = (2 * shape.linear_params * tokens
             + 2 * 2 * tokens * cached * shape.heads * shape.head_dim * shape.layers  # QKᵀ and PV
             + 2 * logits_rows * shape.vocab * shape.hidden)
    total = weights_bytes + e * kv
    return Floor(bytes=float(total), flops=float(flops), memory_s=total / machine.read_bandwidth, compute_s=flops / machine.peak(dtype))


# -- measuring the roofs ----------------------------------------------------------------------------

def _best_seconds(call: Callable[[], object], *, min_seconds: float, blocks: int) -> float:
    """Best per-call time of ``call`` over ``blocks`` blocks, each repeating it for at least
    ``min_seconds`` (after one warm-up call)."""
    call()
    best = float("inf")
    for _ in range(blocks):
        calls, began = 0, time.perf_counter()
        while True:
            call()
            calls += 1
            elapsed = time.perf_counter() - began
            if elapsed >= min_seconds:
                break
        best = min(best, elapsed / calls)
    return best


@attrs.define(eq=False)
class BandwidthProbe:
    """Read bandwidth in bytes/s, measured again at each call over one float32 buffer (its pages touched once,
    when made): the best of ``repeats`` sums of it, after one warm-up sum. ``specstack floor`` calls it between
    the turns of each level's forwards, so that a forward is priced at the bandwidth of its own minutes on a
    shared machine (:func:`specstack.bench.floor.measure`)."""

    buffer: torch.Tensor  # [N] float32, far bigger than the last-level cache
    repeats: int = 2

    @classmethod
    def of(cls, *, mib: int = 512, repeats: int = 2) -> "BandwidthProbe":
        return cls(buffer=torch.ones(mib * 2**20 // 4, dtype=torch.float32, device="cpu"), repeats=repeats)  # [N]

    def __call__(self) -> float:
        with torch.inference_mode():
            seconds = _best_seconds(self.buffer.sum, min_seconds=0.0, blocks=self.repeats)
        return self.buffer.numel() * self.buffer.element_size() / seconds


def measure_bandwidth(*, mib: int = 512, repeats: int = 5) -> float:
    """Read bandwidth in bytes/s: the best of ``repeats`` sums of a float32 buffer of ``mib`` MiB
    (make it far bigger than the last-level cache)."""
    return BandwidthProbe.of(mib=mib, repeats=repeats)()


def measure_gemm(dtype: str, rows: int, pairs: Sequence[tuple[int, int]], *, min_seconds: float = 0.01, blocks: int = 3,
                 generator: torch.Generator | None = None) -> float:
    """flop/s of ``rows`` rows through bias-free linear layers of ``pairs`` of (in, out) features,
    one after another, with the kernel the models use (:mod:`specstack.packed_linear`)."""
    generator = generator or torch.Generator(device="cpu").manual_seed(0)
    torch_dtype = DTYPES[dtype_name(dtype)]
    layers = torch.nn.ModuleList(torch.nn.Linear(inp, out, bias=False, device="meta") for inp, out in pairs)  # no initialisation
    for layer, (inp, out) in zip(layers, pairs):
        weight = torch.randn(out, inp, generator=generator, device="cpu").to(torch_dtype)  # [out, in]
        layer.weight = torch.nn.Parameter(weight, requires_grad=False)
    pack_linears(layers)
    inputs = [torch.randn(rows, inp, generator=generator, device="cpu").to(torch_dtype) for inp, _ in pairs]  # [rows, in] each

    def run() -> None:
        for x, layer in zip(inputs, layers):
            layer(x)  # [rows, out]

    seconds = _best_seconds(run, min_seconds=min_seconds, blocks=blocks)
    return sum(2 * rows * inp * out for inp, out in pairs) / seconds


def measure_machine(shapes: Mapping[str, ModelShape], rows: Sequence[int], *, dtypes: Sequence[str] = ("float32", "bfloat16"),
                    bandwidth_mib: int = 512, square: int = 1024, min_seconds: float = 0.01, blocks: int = 3) -> Machine:
    """Read bandwidth, and matrix-product throughput per dtype at ``rows`` rows through each named
    model shape's layer ("NAME layer") and LM head ("lm head", once per distinct head) and for a
    ``square`` × ``square`` product, at the current torch threads. A dtype's peak is its best measurement."""
    heads = dict.fromkeys((shape.hidden, shape.vocab) for shape in shapes.values())
    with torch.inference_mode():
        bandwidth = measure_bandwidth(mib=bandwidth_mib, repeats=max(blocks, 3))
        gemm: list[Gemm] = []
        for dtype in dict.fromkeys(map(dtype_name, dtypes)):
            pairs = [(f"{name} layer", shape.linear_shapes()) for name, shape in shapes.items()] + [("lm head", [head]) for head in heads]
            for r in rows:
                gemm += [Gemm(dtype=dtype, what=what, rows=r, flops_per_s=measure_gemm(dtype, r, p, min_seconds=min_seconds, blocks=blocks))
                         for what, p in pairs]
            if square:
                gemm.append(Gemm(dtype=dtype, what=f"square {square}", rows=square,
                                 flops_per_s=measure_gemm(dtype, square, [(square, square)], min_seconds=min_seconds, blocks=blocks)))
    peak = {name: max(g.flops_per_s for g in gemm if g.dtype == name) for name in dict.fromkeys(map(dtype_name, dtypes))}
    return Machine(threads=torch.get_num_threads(), read_bandwidth=bandwidth, gemm_peak=peak, bandwidth_mib=bandwidth_mib, gemm=tuple(gemm),
                   cpu_capability=torch.backends.cpu.get_cpu_capability(), onednn_bf16=_onednn_bf16(), bf16_products=_bf16_products())


def _bf16_products() -> str:
    """How the kernels take bf16 products here: the measured rates and the way chosen, or that there are no dot products."""
    from .bf16_products import product_rates

    rates = product_rates()
    return "bf16 products widened to float32 (no bf16 dot products here)" if rates is None else rates.describe()


def _onednn_bf16() -> bool | None:
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a private check: absent from some builds
        return None
