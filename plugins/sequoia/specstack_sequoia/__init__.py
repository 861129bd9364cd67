"""Sequoia token trees for specstack (a plugin distribution): tree shapes, tree drafters, the
hardware-aware tree planner, and stacks that use them (Chen et al., 2024, "Sequoia: Scalable,
Robust, and Hardware-aware Speculative Decoding")."""

from .drafters import SequoiaDrafter, TreeLookupDrafter
from .planner import Costs, Plan, TreeTable, best_tree, measure_costs, plan_tree, positional_acceptance
from .shape import TreeShape

__all__ = ["Costs", "Plan", "SequoiaDrafter", "TreeLookupDrafter", "TreeShape", "TreeTable", "best_tree", "measure_costs",
           "plan_tree", "positional_acceptance"]
