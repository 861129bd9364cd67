"""The entry point specstack loads: registers :class:`~specstack_h2o.policy.H2O` as ``h2o``."""

from specstack.hookspecs import hookimpl

from .policy import H2O


@hookimpl
def specstack_cache_policies() -> list:
    return [H2O]
