"""The entry point specstack loads: the ``medusa`` drafter and the stacks of :mod:`specstack_medusa.recipes`
(``medusa``, ``medusa-chain``, ``triforce-medusa``, ``medusa-lookup``). (Training the heads is ``specstack train medusa``, in the specstack-training distribution.)"""

from specstack.hookspecs import hookimpl

from .drafter import MedusaDrafter
from .recipes import RECIPES


@hookimpl
def specstack_drafters() -> list:
    return [MedusaDrafter]


@hookimpl
def specstack_stacks() -> list:
    return list(RECIPES)
