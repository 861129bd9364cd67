"""Medusa heads for specstack (Cai et al., 2024, "Medusa: Simple LLM Inference Acceleration Framework
with Multiple Decoding Heads"): :class:`~specstack_medusa.heads.MedusaHeads`, the tree of candidates
(:mod:`specstack_medusa.tree`), the drafter (:class:`~specstack_medusa.drafter.MedusaDrafter`) and the
``medusa`` and ``triforce-medusa`` stacks."""

from .drafter import MedusaDrafter
from .heads import MedusaHeads, load_heads, save_heads, shipped_heads

__all__ = ["MedusaDrafter", "MedusaHeads", "load_heads", "save_heads", "shipped_heads"]
