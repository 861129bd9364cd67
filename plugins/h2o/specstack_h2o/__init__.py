"""H2O as a specstack cache policy (a plugin distribution; see :mod:`specstack_h2o.policy`)."""

from .policy import H2O

__all__ = ["H2O"]
