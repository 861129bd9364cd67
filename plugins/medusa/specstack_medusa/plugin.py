"""The entry point specstack loads: the ``medusa`` drafter and the ``medusa`` and ``triforce-medusa``
stacks. (Training the heads is ``specstack train medusa``, in the specstack-training distribution.)"""

from specstack.hookspecs import hookimpl

from .drafter import MedusaDrafter
from .recipes import RECIPES


@hookimpl
def specstack_drafters() -> list:
    return [MedusaDrafter]


@hookimpl
def specstack_stacks() -> list:
    return list(RECIPES)
