"""The entry point specstack loads: the ``lookup-tree`` drafter, the tree stacks (``sequoia``,
``triforce-tree``, ``lookup-tree``, ``triforce-lookup-tree``) and the ``plan-tree`` command.
(:class:`~specstack_sequoia.drafters.SequoiaDrafter` needs a model, so recipes place it at level 0
through ``Level.model_drafter`` rather than registering it as a model-free drafter.)"""

from specstack.hookspecs import hookimpl

from .command import PlanTreeCommand
from .drafters import TreeLookupDrafter
from .recipes import RECIPES


@hookimpl
def specstack_drafters() -> list:
    return [TreeLookupDrafter]


@hookimpl
def specstack_stacks() -> list:
    return list(RECIPES)


@hookimpl
def specstack_commands() -> list:
    return [PlanTreeCommand()]
