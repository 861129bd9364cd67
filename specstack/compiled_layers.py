"""The lean decoder's layers as one compiled call each, for float32 and bfloat16 forwards of a few tokens on the CPU.

After the kernels of :mod:`specstack.packed_linear`, :mod:`specstack.decode_attention` and
:mod:`specstack.decoder_ops`, half of a one-token step of the target over a 512-slot cache was still
Python and torch calls around them (docs/benchmarks.md, "Each layer one compiled call"): some thirty
per layer (module calls, views, the store's writes, the kernels' argument checks, ctypes). Here a
layer is one call to ``csrc/compiled_layers.cpp``, which calls those very kernels from C, with the
arguments the lean decoder passes them, and moves the rows between them itself (the store's writes,
the attention kernel's layout: in bfloat16 its queries widened to float32 and its output rounded back,
as the lean decoder does). The MLP's activation stays the layer module's own, between two calls,
so the forward is the lean decoder's, operation for operation: **the same bits** (tests/test_compiled_layers.py).
In bfloat16 the activation takes 65,536 inputs only, so where a layer's activation is a fixed function (no
parameters or buffers) of a width the vectorized kernels take whole, its output for every one of them is made
once by the module itself into a table, and the C code reads the table and multiplies by up as torch's bf16
multiply rounds. The table is used only where it gives the module's ``act(gate) * up`` bit for bit for every
gate value on rows of the layer's width (:func:`activation_table`); then the whole forward is one C call, with
no Python between the layers (docs/benchmarks.md, "The activation from a table, the forward one call").

:meth:`CompiledLayers.plan_for` is the one place that decides which forwards take it: float32 or
bfloat16 on the CPU (model and cache of one dtype), every product through the few-row kernel and attention through the decode kernel at this many
tokens, nothing else asked of the attention (no attention weights recorded, no sparse attention, not a
graphed forward) and the lean decoder's compiled norms. A query log for a gathering level below is kept
(the query of its row, every layer), and so are the keys as written of a store with cache-relative
positions. Everything else keeps the lean decoder's Python.

The plan of a forward (each product's kernel entry and stored weight, the norms, the shapes) is made
once per number of tokens and made again whenever a weight, a norm or a stored format changed, or what its
entries were chosen from (a product's few-row kernel, the attention kernel's library): the
kernels never read a weight the module no longer holds, and a forward never takes entries chosen for other
kernels. Inside the decoder's ``weights_held`` scope (a generation) that is checked at the first forward of
each width only.
"""

from __future__ import annotations

import ctypes
import operator
from pathlib import Path
from typing import Sequence

import attrs
import torch

from .decoder_ops import DTYPES, RMS_NORMS, DecoderOps
from .native import SOURCES, CompiledLibrary, load
from .packed_linear import PackedLinear
from .parameter_watch import ParameterWatch

SOURCE = SOURCES / "compiled_layers.cpp"
_BLOCKS = operator.attrgetter("_blocks")


class _Product(ctypes.Structure):
    _fields_ = [("entry", ctypes.c_void_p), ("weight", ctypes.c_void_p), ("bias", ctypes.c_void_p), ("out", ctypes.c_int64), ("in_", ctypes.c_int64)]


class _Layer(ctypes.Structure):
    _fields_ = [("qkv", _Product), ("o", _Product), ("gate_up", _Product), ("down", _Product), ("input_norm", ctypes.c_void_p),
                ("post_norm", ctypes.c_void_p), ("input_eps", ctypes.c_float), ("post_eps", ctypes.c_float), ("scale", ctypes.c_float),
                ("act_table", ctypes.c_void_p)]


class _Model(ctypes.Structure):
    _fields_ = [("add_norm", ctypes.c_void_p), ("rotate", ctypes.c_void_p), ("attend", ctypes.c_void_p), ("layers", ctypes.POINTER(_Layer)),
                ("count", ctypes.c_int), ("heads", ctypes.c_int), ("kv_heads", ctypes.c_int), ("head_dim", ctypes.c_int), ("hidden", ctypes.c_int),
                ("inner", ctypes.c_int), ("final_norm", ctypes.c_void_p), ("final_eps", ctypes.c_float), ("bf16", ctypes.c_int)]


class _Step(ctypes.Structure):
    _fields_ = [("t", ctypes.c_int), ("threads", ctypes.c_int), ("cached", ctypes.c_int64)]
    _fields_ += [(name, ctypes.c_void_p) for name in ("hidden", "normed", "delta", "qkv", "query", "attended", "merged", "gate_up", "act", "cos", "sin",
                                                       "sees", "keys", "values", "written")]
    _fields_ += [("capacity", ctypes.c_int64), ("columns", ctypes.c_void_p), ("columns_layer_stride", ctypes.c_int64), ("columns_head_stride", ctypes.c_int64),
                 ("columns_upto", ctypes.c_void_p), ("queries", ctypes.c_void_p), ("query_row", ctypes.c_int), ("amx", ctypes.c_int), ("dp", ctypes.c_int)]


def _address(function) -> int:
    """The address of a ctypes function, for C to call it."""
    return ctypes.cast(function, ctypes.c_void_p).value


@attrs.define(eq=False)
class _Plan:
    """The plan of forwards of one number of tokens: the C model (None where they do not take the compiled
    layers) and what it points into, kept alive here; and what it was made from, to tell when it is stale."""

    model: _Model | None  # its layers array stays alive through the pointer (ctypes keeps what a pointer field was given)
    lean_layers: tuple  # the lean decoder's layers (fused anew when their weights move)
    params: ParameterWatch  # every weight, bias and norm weight read, with their version counters where they keep them
    linears: tuple  # the products that may read a stored weight
    blocks: tuple  # each one's stored weight (or None) when it was made
    storages: tuple = ()  # every parameter's data as read (detached): memory the kernels read stays allocated even where a
    # weight's storage is replaced inside a weights_held scope, which skips the checks until it closes
    tables: tuple | None = None  # each layer's activation table [65536] bf16 where every layer has one: the forward is one call
    kernels: tuple = ()  # what chose its entries, each product's few-row kernel and the attention's library (kept alive: compared by identity)

    def current(self, decoder, kernel) -> bool:
        """Whether ``decoder`` still holds what the plan was made from, and its products and attention ``kernel`` are
        the kernels it chose its entries from (a few hundred checks, in C loops)."""
        return (len(decoder.layers) == len(self.lean_layers) and all(map(operator.is_, decoder.layers, self.lean_layers))
                and self.params.current() and all(map(operator.is_, map(_BLOCKS, self.linears), self.blocks))
                and all(map(operator.is_, _kernels(self.linears, kernel), self.kernels)))


@attrs.define(eq=False)
class CompiledLayers(CompiledLibrary):
    """``csrc/compiled_layers.cpp``, and the plans made for one decoder, one per number of tokens."""

    plans: dict[int, _Plan] = attrs.field(factory=dict)
    forwards: int = 0  # forwards run here
    tables: dict = attrs.field(factory=dict)  # id(activation module) -> (the module, its table or None), made once each

    @classmethod
    def load_again(cls) -> "CompiledLayers | None":
        """Loaded again with no plans: a copied model remakes its plans on its first forwards."""
        return load_compiled_layers()

    def plan_for(self, decoder, tokens: torch.Tensor, cache, attention: dict) -> _Plan | None:
        """The plan of the lean ``decoder``'s forward over ``tokens`` [1, T] into ``cache`` (a StoreCache), with the
        attention function's keyword arguments ``attention``, where it runs here; None where it does not
        (module docstring). The one place that decides."""
        batch, kernel, store = attention.get("specstack_batch"), attention.get("specstack_attention_kernel"), cache.store
        t, dtype = tokens.shape[1], store.keys.dtype
        if (batch is None or kernel is None or cache.view is not None or batch.record_attention or batch.attend is not None
                or store.attention is not None or dtype not in DTYPES or dtype != decoder.model.norm.weight.dtype
                or store.keys.device.type != "cpu" or not isinstance(decoder.ops, DecoderOps)):
            return None
        first = decoder.layers[0]
        if not kernel.takes(dtype, first.heads, first.kv_heads, t, first.head_dim, store.length + t):
            return None
        plan, asked = self.plans.get(t), decoder.asks(("plan", t))
        if plan is None or (asked and not plan.current(decoder, kernel)):
            plan = self.plans[t] = _make_plan(decoder, kernel, t, self.table)
        return plan if plan.model is not None else None

    def run(self, plan: _Plan, decoder, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache, attention: dict) -> torch.Tensor:
        """The embedded tokens ``hidden`` [1, T, H] (updated in place: the residual stream), their rotary cos and
        sin [1, T, D] -> the last hidden states [1, T, H] after the final norm, every layer's keys and values
        written into the store (what the lean decoder's forward computes, the same bits)."""
        batch, store, kernel = attention["specstack_batch"], cache.store, attention["specstack_attention_kernel"]
        first = decoder.layers[0]
        t, width, dtype = hidden.shape[1], hidden.shape[2], hidden.dtype
        hq, hkv, d, inner = first.heads, first.kv_heads, first.head_dim, first.inner
        self.forwards += 1
        sizes = (width, width, (hq + 2 * hkv) * d, hq * d, 2 * inner, inner)  # per token, in the model's dtype: delta, normed, qkv, merged, gate_up, act
        parts = torch.empty(t * sum(sizes), dtype=dtype, device="cpu").split([t * size for size in sizes])  # one allocation for the forward's rows
        query, attended = torch.empty(2 * t * hq * d, dtype=torch.float32, device="cpu").split(t * hq * d)  # the attention kernel's, float32
        states = parts[1].view(1, t, width)  # [1, T, H]: the last norm's output
        gate_up = parts[4].view(1, t, 2 * inner)  # [1, T, 2 I]
        sees = None if batch.is_chain else batch.sees.to(device="cpu", dtype=torch.bool).contiguous().view(torch.uint8)  # [T, T]
        queries = None if batch.queries is None else batch.queries.log(len(decoder.layers), hq, d, dtype, hidden.device)  # [L, Hq, D]
        written = store.written if store.written.numel() else None
        # the store's keys by columns [L, Hkv, C / 16, words, 16] and their marks [L], which the kernel reads and keeps current
        columns, marks = store.key_columns() if kernel.column_keys(dtype, d, hq // hkv * t) else (None, None)
        fields = _Step(t=t, threads=torch.get_num_threads(), cached=store.length, hidden=hidden.data_ptr(), normed=parts[1].data_ptr(),
                       delta=parts[0].data_ptr(), qkv=parts[2].data_ptr(), query=query.data_ptr(), attended=attended.data_ptr(),
                       merged=parts[3].data_ptr(), gate_up=gate_up.data_ptr(), act=None, cos=cos.data_ptr(), sin=sin.data_ptr(),
                       sees=None if sees is None else sees.data_ptr(), keys=store.keys.data_ptr(), values=store.values.data_ptr(),
                       written=None if written is None else written.data_ptr(), capacity=store.capacity,
                       columns=None if columns is None else columns.data_ptr(), columns_layer_stride=0 if columns is None else columns.stride(0),
                       columns_head_stride=0 if columns is None else columns.stride(1), columns_upto=None if marks is None else marks.data_ptr(),
                       queries=None if queries is None else queries.data_ptr(), query_row=batch.query_row,
                       amx=kernel.tiles(dtype, d, t, store.length + t), dp=kernel.dot_products)
        model, step, call = ctypes.byref(plan.model), ctypes.byref(fields), self.library.specstack_layer_step
        if plan.tables is not None:  # every activation from its table: the whole forward in C
            fields.act = parts[5].data_ptr()  # [T * I]: each layer's activation times up
            _check(self.library.specstack_forward(model, step), None)
            return states
        gate, up = gate_up[..., :inner], gate_up[..., inner:]  # [1, T, I] each: every layer writes the same rows
        act = None  # [1, T, I]: kept alive until the next layer's down product has read it
        for i, layer in enumerate(decoder.layers):
            _check(call(model, step, i), i)
            act = layer.act.forward(gate) * up  # [1, T, I], as the lean decoder computes it
            fields.act = act.data_ptr()
        _check(call(model, step, len(decoder.layers)), len(decoder.layers))
        return states

    def table(self, act: torch.nn.Module, inner: int, dtype: torch.dtype) -> torch.Tensor | None:
        """The table of ``act`` (:func:`activation_table`) for rows of ``inner`` in ``dtype``, made at its first use."""
        if dtype != torch.bfloat16:
            return None
        if id(act) not in self.tables:
            self.tables[id(act)] = (act, activation_table(act, inner, self.library.specstack_tabled_act))
        return self.tables[id(act)][1]


EVERY_BF16 = 65536  # bfloat16 bit patterns
VECTOR_WIDTH = 64  # bf16 numbers a step of torch's vectorized elementwise loop takes (two 512-bit vectors); rows of a multiple
# of it take no scalar tail, whose arithmetic may round otherwise


def activation_table(act: torch.nn.Module, inner: int, tabled_act) -> torch.Tensor | None:
    """``act``'s output [65536] bf16 for every bf16 input, where ``tabled_act`` (the C lookup times up) gives the module's
    own ``act(gate) * up`` bit for bit on rows of ``inner``: every gate value once, each beside an up value of every kind
    (a permutation of all bit patterns: finite, zero, subnormal, infinite, NaN). None where it does not, where ``act``
    holds parameters or buffers (not a fixed function), or where ``inner`` is no multiple of VECTOR_WIDTH."""
    if inner % VECTOR_WIDTH or any(True for _ in act.parameters()) or any(True for _ in act.buffers()):
        return None
    bits = torch.arange(EVERY_BF16, dtype=torch.int32)  # [65536]
    with torch.no_grad():
        table = act.forward(bits.to(torch.int16).view(torch.bfloat16)).contiguous()  # [65536] bf16
        rows = -(-EVERY_BF16 // inner)
        gates, ups = torch.zeros(2, rows * inner, dtype=torch.int32)  # [rows * I] each
        gates[:EVERY_BF16], ups[:EVERY_BF16] = bits, bits * 40503 % EVERY_BF16  # an odd multiplier: every pattern once
        gate_up = torch.cat([gates.view(rows, inner), ups.view(rows, inner)], dim=1).to(torch.int16).view(torch.bfloat16)[None]  # [1, rows, 2 I]
        want = act.forward(gate_up[..., :inner]) * gate_up[..., inner:]  # [1, rows, I]
    if table.dtype != torch.bfloat16 or want.dtype != torch.bfloat16:
        return None
    got = torch.empty(rows, inner, dtype=torch.bfloat16)  # [rows, I]
    tabled_act(table.data_ptr(), gate_up.data_ptr(), got.data_ptr(), rows, inner, torch.get_num_threads())
    return table if torch.equal(got.view(torch.int16), want[0].view(torch.int16)) else None


def _check(status: int, layer: int | None) -> None:
    """Raise where a compiled call failed: one layer's step, or (``layer`` None) the whole forward."""
    if status != 0:
        what = "the forward" if layer is None else f"layer {layer}'s forward"
        raise ValueError(f"a compiled kernel refused {what} (status {status})")


def _make_plan(decoder, kernel, t: int, table) -> _Plan:
    """The plan of ``decoder``'s forwards of ``t`` tokens of its dtype (its model None where some part of them
    does not take the compiled kernels); ``table(act, inner, dtype)`` gives a layer's activation table, or None."""
    linears = [linear for layer in decoder.layers for linear in (layer.qkv.linear, layer.o_proj, layer.gate_up.linear, layer.down_proj)]
    norms = [decoder.model.norm] + [norm for layer in decoder.layers for norm in (layer.input_norm, layer.post_norm)]
    dtype = decoder.model.norm.weight.dtype
    products = [_product(linear, t, dtype) for linear in linears]  # first: asking drops stored weights that no longer widen to theirs
    owners = ([(linear, "weight") for linear in linears] + [(linear, "bias") for linear in linears if linear.bias is not None]
              + [(norm, "weight") for norm in norms])
    stored = tuple(linear for linear in linears if isinstance(linear, PackedLinear))
    params = ParameterWatch.now(owners, versions=True)
    plan = _Plan(model=None, lean_layers=tuple(decoder.layers), params=params, linears=stored, blocks=tuple(linear._blocks for linear in stored),
                 storages=tuple(param.detach() for param in params.params), kernels=_kernels(stored, kernel))
    if None in products or any(type(norm).__name__ not in RMS_NORMS or norm.weight.dtype != dtype or not norm.weight.is_contiguous() for norm in norms):
        return plan
    tables = [table(layer.act, layer.inner, dtype) for layer in decoder.layers]
    plan.tables = tuple(tables) if all(each is not None for each in tables) else None
    layers = (_Layer * len(decoder.layers))()
    for i, (slot, layer) in enumerate(zip(layers, decoder.layers)):
        slot.qkv, slot.o, slot.gate_up, slot.down = products[4 * i : 4 * i + 4]
        slot.input_norm, slot.post_norm = layer.input_norm.weight.data_ptr(), layer.post_norm.weight.data_ptr()
        slot.input_eps, slot.post_eps = float(layer.input_norm.variance_epsilon), float(layer.post_norm.variance_epsilon)
        scaling = layer.attention.scaling
        slot.scale = scaling if scaling is not None else layer.head_dim**-0.5
        slot.act_table = plan.tables[i].data_ptr() if plan.tables is not None else None
    first, ops = decoder.layers[0], decoder.ops.library
    plan.model = _Model(add_norm=_address(ops.add_rms_norm), rotate=_address(ops.rotate), attend=_address(kernel.library.specstack_decode_attention_columns),
                        layers=layers, count=len(decoder.layers), heads=first.heads, kv_heads=first.kv_heads, head_dim=first.head_dim,
                        hidden=decoder.model.norm.weight.shape[0], inner=first.inner, final_norm=decoder.model.norm.weight.data_ptr(),
                        final_eps=float(decoder.model.norm.variance_epsilon), bf16=DTYPES[dtype])
    return plan


def _kernels(linears: Sequence[PackedLinear], kernel) -> tuple:
    """What a plan's kernel entries are chosen from: each product's few-row kernel (a kernel switched or evolved,
    its ``tiles_from`` among them, is a new object) and the attention ``kernel``'s library."""
    return (*(linear._rows for linear in linears), kernel.library)


def _product(linear: torch.nn.Module, t: int, dtype: torch.dtype) -> _Product | None:
    """The C description of ``linear``'s product of ``t`` rows of ``dtype``, None where the few-row kernel does not take it."""
    weight = linear._parameters["weight"]
    taken = linear.rows_product(t) if isinstance(linear, PackedLinear) and weight.dtype == dtype else None
    if taken is None:
        return None
    entry, stored, bias = taken
    return _Product(entry=_address(entry), weight=stored.data_ptr(), bias=None if bias is None else bias.data_ptr(), out=weight.shape[0], in_=weight.shape[1])


def load_compiled_layers(cache: Path | None = None) -> CompiledLayers | None:
    """The compiled layer calls, built into ``cache`` (default: the specstack cache) on first use; None where
    they cannot be built here."""
    loaded = load(SOURCE, "specstack_layer_step", [ctypes.POINTER(_Model), ctypes.POINTER(_Step), ctypes.c_int], cache)
    if loaded is None:
        return None
    library, path = loaded
    library.specstack_forward.restype, library.specstack_forward.argtypes = ctypes.c_int, [ctypes.POINTER(_Model), ctypes.POINTER(_Step)]
    library.specstack_tabled_act.restype = None
    library.specstack_tabled_act.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    return CompiledLayers(library=library, path=path)
