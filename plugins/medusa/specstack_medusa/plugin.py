"""The entry point specstack loads: the ``medusa`` and ``eagle`` drafters and the stacks of :mod:`specstack_medusa.recipes`
(``medusa``, ``medusa-chain``, ``triforce-medusa``, ``medusa-lookup``, ``triforce-medusa-lookup``, ``eagle``, ``eagle-lookup``,
``triforce-eagle-lookup``). (Training the heads is ``specstack train medusa``, in the specstack-training distribution.)"""

from specstack.hookspecs import hookimpl

from .drafter import MedusaDrafter
from .eagle_drafter import EagleDrafter
from .recipes import RECIPES


@hookimpl
def specstack_drafters() -> list:
    return [MedusaDrafter, EagleDrafter]


@hookimpl
def specstack_stacks() -> list:
    return list(RECIPES)
