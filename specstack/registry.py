"""The component registry: one pluggy plugin manager per registry, no global state.

``Registry.create()`` registers the built-in plugin and every plugin found in the ``specstack``
entry-point group, then collects components through the hooks of :mod:`specstack.hookspecs`.
Names resolve here; an unknown name gets a one-line error listing what is available.
"""

from __future__ import annotations

import enum
import importlib.metadata
import inspect
import warnings
from typing import Any, Iterable

import attrs
import pluggy

from . import hookspecs
from .errors import SpecstackError

ENTRY_POINT_GROUP = "specstack"


class Kind(str, enum.Enum):
    CACHE_POLICY = "cache policy"
    DRAFTER = "drafter"
    VERIFIER = "verifier"
    STACK = "stack"
    COMMAND = "command"


_HOOKS = {
    Kind.CACHE_POLICY: "specstack_cache_policies",
    Kind.DRAFTER: "specstack_drafters",
    Kind.VERIFIER: "specstack_verifiers",
    Kind.STACK: "specstack_stacks",
    Kind.COMMAND: "specstack_commands",
}


@attrs.frozen(kw_only=True)
class Entry:
    """One registered component and where it came from."""

    kind: Kind
    name: str
    component: Any
    plugin: str
    distribution: str | None

    @property
    def capabilities(self) -> tuple[str, ...]:
        return tuple(sorted(c.value for c in getattr(self.component, "requires", ())))


@attrs.frozen(kw_only=True)
class PluginProblem:
    """A plugin that could not be used, and why (reported, never fatal to the others)."""

    plugin: str
    problem: str


class PluginWarning(UserWarning):
    """A plugin failed to load or conflicts with another."""


@attrs.define(eq=False)
class Registry:
    manager: pluggy.PluginManager
    entries: dict[Kind, dict[str, Entry]] = attrs.field(factory=lambda: {kind: {} for kind in Kind})
    problems: list[PluginProblem] = attrs.field(factory=list)
    _distributions: dict[str, str | None] = attrs.field(factory=dict)

    @classmethod
    def create(cls, *, builtins: bool = True, entry_points: bool = True, plugins: Iterable[Any] = ()) -> "Registry":
        """A registry with the built-ins, the installed entry-point plugins and ``plugins``."""
        registry = cls(pluggy.PluginManager("specstack"))
        registry.manager.add_hookspecs(hookspecs)
        if builtins:
            from . import builtins as builtin_plugin

            registry.register(builtin_plugin, name="specstack.builtins", distribution="specstack")
        if entry_points:
            registry._load_entry_points()
        for plugin in plugins:
            registry.register(plugin)
        registry.collect()
        return registry

    def register(self, plugin: Any, *, name: str | None = None, distribution: str | None = None) -> None:
        """Register one plugin object or module; a broken one is recorded in ``problems``."""
        name = name or getattr(plugin, "__name__", None) or repr(plugin)
        try:
            self.manager.register(plugin, name=name)
            self._check_hooks(plugin, name)
        except Exception as error:  # a plugin's fault must not break the others
            self._problem(name, f"cannot be registered: {_one_line(error)}")
            return
        self._distributions[name] = distribution

    def _check_hooks(self, plugin: Any, name: str) -> None:
        known = set(_HOOKS.values())
        for attr in dir(plugin):
            if attr.startswith("specstack_") and attr not in known:
                self.manager.unregister(name=name)
                raise SpecstackError(f"it implements unknown hook '{attr}'; known hooks: {', '.join(sorted(known))}")

    def _load_entry_points(self) -> None:
        for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            dist = ep.dist.name if ep.dist else None
            if self.manager.has_plugin(ep.name):
                continue
            try:
                plugin = ep.load()
            except Exception as error:
                self._problem(ep.name, f"failed to import ({ep.value}): {_one_line(error)}")
                continue
            self.register(plugin, name=ep.name, distribution=dist)

    def collect(self) -> None:
        """Ask every plugin for its components (plugin by plugin, so one bad plugin is isolated)."""
        for plugin_name, plugin in self.manager.list_name_plugin():
            for kind, hook in _HOOKS.items():
                impl = getattr(plugin, hook, None)
                if impl is None:
                    continue
                try:
                    components = list(impl())
                except Exception as error:
                    self._problem(plugin_name, f"hook {hook} failed: {_one_line(error)}")
                    continue
                for component in components:
                    self._add(kind, component, plugin_name)

    def _add(self, kind: Kind, component: Any, plugin: str) -> None:
        name = getattr(component, "name", None)
        if not isinstance(name, str) or not name:
            self._problem(plugin, f"registered a {kind.value} without a name: {component!r}")
            return
        taken = self.entries[kind].get(name)
        if taken is not None:
            self._problem(plugin, f"{kind.value} '{name}' is already registered by {taken.plugin}; kept that one")
            return
        self.entries[kind][name] = Entry(kind=kind, name=name, component=component, plugin=plugin, distribution=self._distributions.get(plugin))

    def _problem(self, plugin: str, problem: str) -> None:
        self.problems.append(PluginProblem(plugin=plugin, problem=problem))
        warnings.warn(f"specstack plugin '{plugin}' {problem}", PluginWarning, stacklevel=3)

    # -- lookup -------------------------------------------------------------------------------

    def names(self, kind: Kind) -> list[str]:
        return sorted(self.entries[kind])

    def entry(self, kind: Kind, name: str) -> Entry:
        try:
            return self.entries[kind][name]
        except KeyError:
            available = ", ".join(self.names(kind)) or "none"
            raise SpecstackError(f"unknown {kind.value} {name!r}; available: {available}") from None

    def cache_policy(self, name: str, **params: Any):
        return _instantiate(self.entry(Kind.CACHE_POLICY, name), params)

    def drafter(self, name: str, *, vocab: int, **params: Any):
        return _instantiate(self.entry(Kind.DRAFTER, name), {"vocab": vocab, **params})

    def verifier(self, name: str):
        return _instantiate(self.entry(Kind.VERIFIER, name), {})

    def stack_recipe(self, name: str):
        return self.entry(Kind.STACK, name).component

    def command(self, name: str):
        return self.entry(Kind.COMMAND, name).component

    def stack(self, name: str, *, target, draft=None, sampling=None, verifier: str | None = None, stop_tokens=(), seed: int = 0, **options):
        """Build the registered stack recipe ``name`` into a :class:`~specstack.stack.SpeculationStack`."""
        from .sampling import SamplingConfig
        from .stack import SpeculationStack

        levels = self.stack_recipe(name).levels(self, target=target, draft=draft, **options)
        return SpeculationStack.build(
            levels,
            sampling=sampling or SamplingConfig(),
            verifier=self.verifier(verifier) if verifier else None,
            stop_tokens=stop_tokens,
            seed=seed,
        )


def _instantiate(entry: Entry, params: dict[str, Any]) -> Any:
    accepted = inspect.signature(entry.component).parameters
    unknown = [key for key in params if key not in accepted]
    if unknown:
        allowed = ", ".join(k for k in accepted if k != "vocab") or "none"
        raise SpecstackError(f"{entry.kind.value} '{entry.name}' has no parameter '{unknown[0]}'; parameters: {allowed}")
    return entry.component(**params)


def _one_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}".rstrip(": ")
