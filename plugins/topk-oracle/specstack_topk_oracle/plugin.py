"""The entry point specstack loads: registers :class:`~specstack_topk_oracle.policy.TopKOracle` as ``topk-oracle``."""

from specstack.hookspecs import hookimpl

from .policy import TopKOracle


@hookimpl
def specstack_cache_policies() -> list:
    return [TopKOracle]
