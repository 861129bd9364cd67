"""The CPU forward of a Llama-family decoder (Llama, Mistral, Qwen2) without transformers' per-layer Python.

transformers' decoder makes about 395 module calls per forward (13 per layer), each around a few small
tensor operations (its RMSNorm alone is eight); for SmolLM2-135M on 2 cores that was a quarter of a one-token step over a 512-slot cache (7.5 of 23 ms,
docs/benchmarks.md, "The decoder's own Python"). :class:`LeanDecoder` computes the same layers with
the same modules' weights and fewer calls:

* each layer's q, k and v products are one matrix product, and so are its MLP's gate and up products:
  the layer's ``q_proj``, ``k_proj`` and ``v_proj`` weights become row blocks of one contiguous matrix
  (views: no copy, the state dict unchanged), and likewise ``gate_proj`` and ``up_proj``;
* each residual add is fused with the norm after it, and the queries and keys are rotated in place,
  one compiled call each (:mod:`specstack.decoder_ops`; transformers' own operations where it cannot
  be built);
* attention is specstack's own (:func:`specstack.hf.grouped_attention`, which the transformers path
  also uses), the activation the module's own forward, the products :class:`PackedLinear`'s.

It computes what the transformers forward computes, operation for operation, so results agree with
it to rounding: each output of the few-row kernel is summed in one fixed order whatever matrix holds
its weight row, so up to its row count, with torch's small operations (``decoder_ops.TORCH_OPS``), the
two paths give the same bits; the compiled norm sums its squares in another order, a float32 last
place (tests/test_decoder.py). Wider products go through oneDNN, whose blocking may round a fused
matrix differently.

It takes forwards of up to :data:`MAX_TOKENS` tokens. Against the transformers forward, bf16, 2 threads,
one process: 1.20x faster at one token over 512 cached slots, 1.13-1.17x over 7,500, 1.09-1.15x for 16
to 256 tokens over 1,024; but 0.80x for a prefill of two 2,048-token chunks (0.85x in fp32), which
therefore keeps the transformers forward.

Float32 forwards of a few tokens go one step further where they can (:mod:`specstack.compiled_layers`):
each layer is one compiled call to the same kernels, with the same bits.

A layer whose weights moved (``.to()``, ``.data =``, a load) is fused again before its next forward.
Inside :meth:`LeanDecoder.weights_held` (a generation: ``SpeculationStack.generate`` opens it for each of its
models) the weights are checked at the first forward only, and the compiled plan of each width at its first
forward: the checks read a few hundred tensors with the CPU's caches cold from streaming the weights, and
bf16 forwards of the embedded target ran 1.03-1.10x faster without them (docs/benchmarks.md, "The weights checked
once a generation").
The LM head stays with the caller (``HFCausalLM._run``), as it does after transformers' decoder.
"""

from __future__ import annotations

import contextlib
from typing import Hashable, Iterator

import attrs
import torch

from .compiled_layers import CompiledLayers, load_compiled_layers
from .decoder_ops import TORCH_OPS, DecoderOps, TorchOps, load_decoder_ops
from .packed_linear import PackedLinear
from .parameter_watch import ParameterWatch
from .weight_formats import join_rows

MAX_TOKENS = 256  # the widest forward taken here; prefill chunks (2,048 tokens) run faster through transformers

# What a decoder layer must hold for this forward: transformers' Llama, Mistral and Qwen2 layers do.
LAYER_PARTS = ("input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "mlp.act_fn")


@attrs.define(eq=False)
class FusedProducts:
    """Row blocks of one weight matrix, one product: the ``parts``' weights (and biases) are views of
    ``linear``'s, in order, so ``linear(x)`` is their outputs side by side."""

    linear: torch.nn.Linear  # a PackedLinear where the parts are
    views: tuple[tuple[torch.nn.Module, str, torch.nn.Parameter, int], ...]  # (part, "weight" or "bias", its parameter, the address it views)

    @classmethod
    def fuse(cls, parts: tuple[torch.nn.Linear, ...]) -> "FusedProducts":
        """Copy the parts' weights into one matrix and make each part's weight a view of its rows."""
        weight = torch.cat([p.weight.detach() for p in parts])  # [sum of outs, in]
        has_bias = parts[0].bias is not None
        bias = torch.cat([p.bias.detach() for p in parts]) if has_bias else None  # [sum of outs]
        linear = torch.nn.utils.skip_init(torch.nn.Linear, weight.shape[1], weight.shape[0], bias=has_bias, device=weight.device, dtype=weight.dtype)
        linear.weight.data = weight
        if has_bias:
            linear.bias.data = bias
        views, row = [], 0
        for part in parts:
            rows = part.weight.shape[0]
            part.weight.data = weight[row : row + rows]  # [rows, in], a view
            views.append((part, "weight", part.weight, part.weight.data_ptr()))
            if has_bias:
                part.bias.data = bias[row : row + rows]  # [rows], a view
                views.append((part, "bias", part.bias, part.bias.data_ptr()))
            row += rows
        if isinstance(parts[0], PackedLinear):
            PackedLinear.adopt(linear, parts[0]._rows)
        linear.requires_grad_(False)
        product = cls(linear=linear, views=tuple(views))
        product.attach_part_blocks()
        return product

    def attach_part_blocks(self) -> None:
        """Give the fused product its parts' stored weights (:mod:`specstack.weight_formats`), rows in the
        parts' order, where every part holds them in one format."""
        parts = list(dict.fromkeys(part for part, *_ in self.views))  # in order, each once
        if isinstance(self.linear, PackedLinear) and all(getattr(p, "_blocks", None) is not None for p in parts):
            if len({p._format for p in parts}) == 1:
                self.linear.attach_blocks(join_rows([p._blocks for p in parts], parts[0]._format), parts[0]._format)

    def current(self) -> bool:
        """Whether every part's weight (and bias) is still the same parameter viewing the fused matrix."""
        return ParameterWatch.of(self.views).current()


@attrs.define(eq=False, kw_only=True)
class LeanLayer:
    """One decoder layer: its modules and shapes read once, its q/k/v and gate/up products fused."""

    layer: torch.nn.Module
    qkv: FusedProducts
    gate_up: FusedProducts
    attention: torch.nn.Module  # the layer's self_attn, handed to the attention function
    input_norm: torch.nn.Module
    post_norm: torch.nn.Module
    o_proj: torch.nn.Module
    down_proj: torch.nn.Module
    act: torch.nn.Module
    heads: int
    kv_heads: int
    head_dim: int
    inner: int  # the MLP's width: gate's outputs, then up's, in the fused product

    @classmethod
    def of(cls, layer: torch.nn.Module) -> "LeanLayer":
        attn, mlp = layer.self_attn, layer.mlp
        d = attn.head_dim
        return cls(layer=layer, qkv=FusedProducts.fuse((attn.q_proj, attn.k_proj, attn.v_proj)), gate_up=FusedProducts.fuse((mlp.gate_proj, mlp.up_proj)),
                   attention=attn, input_norm=layer.input_layernorm, post_norm=layer.post_attention_layernorm, o_proj=attn.o_proj,
                   down_proj=mlp.down_proj, act=mlp.act_fn, heads=attn.q_proj.weight.shape[0] // d, kv_heads=attn.k_proj.weight.shape[0] // d,
                   head_dim=d, inner=mlp.gate_proj.weight.shape[0])

    def current(self) -> bool:
        return self.qkv.current() and self.gate_up.current()

    def forward(self, hidden: torch.Tensor, delta: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, cache, attend, attention: dict,
                ops) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [1, T, H] and the previous layer's MLP output ``delta`` (None for the first layer), cos/sin
        [1, T, 1, D] -> the residual stream before this layer's MLP output, and that output, [1, T, H] each
        (pre-norm attention and MLP, each added to the residual stream; the last add is the next layer's
        to make, fused with its norm by ``ops``)."""
        t, d, heads, kv_heads = hidden.shape[1], self.head_dim, self.heads, self.kv_heads
        hidden, x = ops.add_norm(hidden, delta, self.input_norm)  # [1, T, H] each
        qkv = self.qkv.linear.forward(x).view(1, t, heads + 2 * kv_heads, d)  # [1, T, Hq + 2 Hkv, D]
        qk = ops.rotate(qkv, cos, sin, heads + kv_heads)  # [1, T, Hq + Hkv, D]
        query = qk[:, :, :heads].transpose(1, 2)  # [1, Hq, T, D]
        key, value = qk[:, :, heads:].transpose(1, 2), qkv[:, :, heads + kv_heads :].transpose(1, 2)  # [1, Hkv, T, D] each
        keys, values = cache.update(key, value, self.attention.layer_idx)  # [1, Hkv, n, D] each
        out, _ = attend(self.attention, query, keys, values, None, scaling=self.attention.scaling, **attention)  # [1, T, Hq, D]
        hidden, x = ops.add_norm(hidden, self.o_proj.forward(out.reshape(1, t, heads * d)), self.post_norm)  # [1, T, H] each
        gate_up = self.gate_up.linear.forward(x)  # [1, T, 2 I]
        return hidden, self.down_proj.forward(self.act.forward(gate_up[..., : self.inner]) * gate_up[..., self.inner :])  # [1, T, H] each


def fits(module: torch.nn.Module) -> bool:
    """Whether ``module`` (a transformers ``...ForCausalLM``) has the decoder this forward computes."""
    model = getattr(module, "model", None)
    layers = getattr(model, "layers", None)
    if layers is None or not all(hasattr(model, name) for name in ("embed_tokens", "rotary_emb", "norm")):
        return False
    for layer in layers:
        for path in LAYER_PARTS:
            owner = layer
            for name in path.split("."):
                owner = getattr(owner, name, None)
            if owner is None:
                return False
        attn = layer.self_attn
        if type(attn.q_proj) not in (torch.nn.Linear, PackedLinear) or not hasattr(attn, "head_dim") or not hasattr(attn, "scaling"):
            return False
    return True


@attrs.define(eq=False)
class LeanDecoder:
    """A transformers Llama-family model's decoder (``module.model``) on the CPU, fewer calls per layer
    (module docstring)."""

    model: torch.nn.Module  # the module's decoder: embedding, layers, final norm, rotary embedding
    layers: list[LeanLayer]
    ops: DecoderOps | TorchOps = TORCH_OPS  # the layers' small operations: compiled where they could be built
    compiled: CompiledLayers | None = None  # each layer one compiled call, for the forwards it applies to (None: not built here)
    watch: ParameterWatch | None = None  # every fused part's weight (and bias) as the layers were fused: asked before each forward
    held: int = 0  # weights_held() scopes open: while any is, each check of the weights runs once
    checked: set = attrs.field(factory=set)  # the checks run since the outermost scope opened: "layers", and ("plan", width)

    @classmethod
    def build(cls, module: torch.nn.Module) -> "LeanDecoder | None":
        """The lean forward of ``module``, fusing its layers' products; None where it does not fit (:func:`fits`)
        or lives off the CPU."""
        if not fits(module) or next(module.parameters()).device.type != "cpu":
            return None
        with torch.no_grad():
            return cls(model=module.model, layers=[LeanLayer.of(layer) for layer in module.model.layers], ops=load_decoder_ops(),
                       compiled=load_compiled_layers())

    def products(self) -> list[FusedProducts]:
        """Every layer's fused q/k/v and gate/up products, layer by layer."""
        return [product for layer in self.layers for product in (layer.qkv, layer.gate_up)]

    def attach_part_blocks(self) -> None:
        """Each layer's fused q/k/v and gate/up products take their parts' stored weights (given to the parts after fusing)."""
        for product in self.products():
            product.attach_part_blocks()

    def applies(self, tokens: torch.Tensor) -> bool:
        """Whether a forward over ``tokens`` [1, T] runs here: on the CPU, at most MAX_TOKENS of them."""
        return tokens.device.type == "cpu" and tokens.shape[1] <= MAX_TOKENS

    def run(self, tokens: torch.Tensor, rope: torch.Tensor, cache, attend, **attention) -> torch.Tensor:
        """tokens and rotary positions [1, T] -> the last hidden states [1, T, H] (after the final norm, as
        transformers' decoder returns them); ``cache`` takes each layer's keys and values, ``attend`` is
        the attention function, ``attention`` its keyword arguments."""
        self._fuse_moved()
        model = self.model
        hidden = model.embed_tokens(tokens)  # [1, T, H]
        cos, sin = model.rotary_emb(hidden, position_ids=rope)  # [1, T, D] each
        plan = None if self.compiled is None else self.compiled.plan_for(self, tokens, cache, attention)
        if plan is not None:
            return self.compiled.run(plan, self, hidden, cos.contiguous(), sin.contiguous(), cache, attention)  # [1, T, H]
        cos, sin = cos[:, :, None], sin[:, :, None]  # [1, T, 1, D]: one angle per token, every head
        delta = None
        for layer in self.layers:
            hidden, delta = layer.forward(hidden, delta, cos, sin, cache, attend, attention, self.ops)  # [1, T, H] each
        return self.ops.add_norm(hidden, delta, model.norm)[1]  # [1, T, H]

    @contextlib.contextmanager
    def weights_held(self) -> Iterator[None]:
        """A scope over which the weights stay as they are (a generation): each check of them (:meth:`asks`) runs at the
        first forward that needs it and not again until the outermost scope closes. Weights changed inside it are
        not seen before then."""
        self.held += 1
        try:
            yield
        finally:
            self.held -= 1
            if not self.held:
                self.checked.clear()

    def asks(self, check: Hashable) -> bool:
        """Whether ``check`` (``"layers"``, or ``("plan", width)``) is to run before this forward: always, except where it
        already ran inside an open :meth:`weights_held` scope."""
        if check in self.checked:
            return False
        if self.held:
            self.checked.add(check)
        return True

    def _fuse_moved(self) -> None:
        """Fuse again any layer whose weights were replaced since they were fused (all of them asked at once, then
        layer by layer where some were)."""
        if not self.asks("layers") or (self.watch is not None and self.watch.current()):
            return
        stale = [i for i, layer in enumerate(self.layers) if not layer.current()]
        if stale:
            with torch.inference_mode(False), torch.no_grad():
                for i in stale:
                    self.layers[i] = LeanLayer.of(self.layers[i].layer)
        self.watch = ParameterWatch.of(view for product in self.products() for view in product.views)
