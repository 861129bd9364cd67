"""The plugin contract: the hooks through which components register.

Every hook is called once, when a :class:`~specstack.registry.Registry` is created, on every
registered plugin (the built-ins in :mod:`specstack.builtins` are one such plugin). Each returns a
list of components; each component carries its registry ``name`` as a class attribute, and a name may
be registered only once per kind. Plugins are found through the ``specstack`` entry-point group::

    [project.entry-points.specstack]
    my-policy = "my_package.plugin"      # a module (or object) with @hookimpl functions

Hooks serve discovery only; nothing is called per token or per layer.
"""

from __future__ import annotations

import pluggy

hookspec = pluggy.HookspecMarker("specstack")
hookimpl = pluggy.HookimplMarker("specstack")


@hookspec
def specstack_cache_policies() -> list:
    """Return :class:`~specstack.policies.CachePolicy` subclasses. Each is instantiated with keyword
    parameters from configuration or the CLI (its defaults must be valid; a bad value raises a one-line
    ``SpecstackError``), and declares in ``requires`` the model capabilities it needs. A policy that
    does not keep everything takes ``budget=`` (KV entries per layer and head), so that stacks such as
    ``self-speculative`` can use any policy by name. :mod:`specstack.testing.conformance` checks this."""


@hookspec
def specstack_drafters() -> list:
    """Return model-free :class:`~specstack.drafters.Drafter` classes usable at level 0. Each is
    instantiated with ``vocab=<vocabulary size>`` plus keyword parameters."""


@hookspec
def specstack_verifiers() -> list:
    """Return :class:`~specstack.verify.Verifier` subclasses (instantiated without arguments)."""


@hookspec
def specstack_stacks() -> list:
    """Return :class:`~specstack.recipes.StackRecipe` objects: named ways to turn models and
    parameters into a list of :class:`~specstack.stack.Level`."""


@hookspec
def specstack_commands() -> list:
    """Return command objects, each a ``specstack`` subcommand: ``name`` (str), ``help`` (one line),
    ``add_arguments(parser)`` (adds its flags to an ``argparse`` parser) and ``run(args) -> int``
    (the exit code). A :class:`~specstack.errors.SpecstackError` raised by ``run`` is printed as one
    line and exits with code 2, as for the built-in commands; a name a built-in command already uses
    is ignored. Loading weights belongs in ``run``, not at import."""
