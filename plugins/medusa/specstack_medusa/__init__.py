"""Medusa heads for specstack (Cai et al., 2024, "Medusa: Simple LLM Inference Acceleration Framework
with Multiple Decoding Heads"): :class:`~specstack_medusa.heads.MedusaHeads`, the tree of candidates
(:mod:`specstack_medusa.tree`), the drafter (:class:`~specstack_medusa.drafter.MedusaDrafter`) and the
``medusa`` stacks; and EAGLE's draft layer (Li et al., 2024; :mod:`specstack_medusa.eagle`), drafting the same trees
(:class:`~specstack_medusa.eagle_drafter.EagleDrafter`) in the ``eagle`` stacks."""

from .drafter import MedusaDrafter
from .eagle import EagleLayer, load_layer, save_layer
from .eagle_drafter import EagleDrafter
from .heads import MedusaHeads, load_heads, save_heads, shipped_heads

__all__ = ["EagleDrafter", "EagleLayer", "MedusaDrafter", "MedusaHeads", "load_heads", "load_layer", "save_heads", "save_layer", "shipped_heads"]
