"""The Top-K attention oracle as a specstack cache policy (see :mod:`specstack_topk_oracle.policy`)."""

from .policy import TopKOracle

__all__ = ["TopKOracle"]
