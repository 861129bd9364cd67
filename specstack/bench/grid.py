"""The benchmark grid: which stacks to run, and the axes whose values are crossed.

A :class:`Grid` names stacks (registered stack recipes or the HF baselines of
:mod:`specstack.bench.stacks`, each optionally with fixed options: ``"triforce:budget=1024,gamma2=6"``)
and axes. Task axes (tasks, context lengths, temperatures, seeds) are crossed for every stack; option
axes (budgets, chunk sizes, γ's) only for a stack whose recipe has that option and does not fix it,
so no run is duplicated. :func:`expand` turns a grid into :class:`Point` s, each with a stable id (a
hash of its configuration) used to resume an interrupted benchmark.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
from pathlib import Path
from typing import Any, Iterable, Mapping

import attrs

from ..errors import SpecstackError
from ..run import check_device, parse_options, split_spec, widening_asked
from .tasks import task_by_name

DTYPES = ("float32", "bfloat16", "float16")


@attrs.frozen(kw_only=True)
class Axis:
    """A grid field whose values are passed to stacks as the recipe option ``option``."""

    field: str
    option: str


OPTION_AXES = (
    Axis(field="budgets", option="budget"),
    Axis(field="chunk_sizes", option="chunk_size"),
    Axis(field="gammas", option="gamma"),
    Axis(field="gamma1s", option="gamma1"),
    Axis(field="gamma2s", option="gamma2"),
    Axis(field="trees", option="tree"),
    Axis(field="policies", option="policy"),
)


@attrs.frozen(kw_only=True)
class Spec:
    """``name`` or ``name:key=value,key=value`` (a stack or a task with fixed options)."""

    name: str
    options: tuple[tuple[str, Any], ...] = ()

    @classmethod
    def parse(cls, text: str, what: str) -> "Spec":
        name, options = split_spec(text, what)
        return cls(name=name, options=tuple(sorted(parse_options(options).items())))

    @property
    def text(self) -> str:
        return label(self.name, dict(self.options))


def label(name: str, options: Mapping[str, Any]) -> str:
    """``triforce`` or ``triforce:budget=256,gamma2=6`` (options sorted)."""
    return name + (":" + ",".join(f"{k}={v}" for k, v in sorted(options.items())) if options else "")


# -- field converters and validators: every bad value becomes one SpecstackError line -------------


def _as_tuple(value: Any) -> Any:
    """Lists become tuples and a lone value a 1-tuple; ``None`` (unset) and tables are left for the validator."""
    if value is None or isinstance(value, Mapping):
        return value
    if isinstance(value, Iterable) and not isinstance(value, (str, bytes)):
        return tuple(value)
    return (value,)


def _axis(kind: str, check) -> Any:
    def validate(instance, attribute, value) -> None:
        if value is None and attribute.default is None:
            return
        if not isinstance(value, tuple) or not value or not all(check(v) for v in value):
            raise SpecstackError(f"grid key '{attribute.name}' must be a non-empty list of {kind}; got {_show(value)}")
        if len(set(value)) != len(value):
            raise SpecstackError(f"grid key '{attribute.name}' lists a value twice: {_show(value)}")

    return validate


def _show(value: Any) -> str:
    """A grid key's value as its file would give it: a stack or task spec as its text (``triforce:budget=256``)."""
    return json.dumps(list(value) if isinstance(value, tuple) else value, default=lambda v: v.text if isinstance(v, Spec) else repr(v))


def _is_int(minimum: int):
    return lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= minimum


def _is_temperature(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0


def _specs(what: str):
    def convert(value: Any) -> Any:
        value = _as_tuple(value)
        if not isinstance(value, tuple):
            return value
        return tuple(v if isinstance(v, Spec) else Spec.parse(v, what) for v in value)

    return convert


def _check_tasks(instance, attribute, value) -> None:
    _axis("task names", lambda v: isinstance(v, Spec))(instance, attribute, value)
    for spec in value:
        task_by_name(spec.name).check_options(dict(spec.options))


def _scalar(kind: str, check, allow_none: bool = False):
    def validate(instance, attribute, value) -> None:
        if not ((allow_none and value is None) or check(value)):
            raise SpecstackError(f"grid key '{attribute.name}' must be {kind}; got {_show(value)}")

    return validate


def _device(instance, attribute, value) -> None:
    """Unset (``None``) or ``cpu``, ``cuda``, ``cuda:N``; whether it exists is checked where the models load."""
    if value is None:
        return
    if not isinstance(value, str):
        raise SpecstackError(f"grid key '{attribute.name}' must be cpu, cuda or cuda:N; got {_show(value)}")
    try:
        check_device(value, available=False)
    except SpecstackError as error:
        raise SpecstackError(f"grid key '{attribute.name}': {error}") from None


def _floats(value: Any) -> Any:
    value = _as_tuple(value)
    return tuple(float(v) if _is_temperature(v) else v for v in value) if isinstance(value, tuple) else value


def _option_axis(minimum: int = 1):
    """An option axis: unset (``None``, the recipes' defaults) or a non-empty list of integers >= ``minimum``."""
    return attrs.field(default=None, converter=_as_tuple, validator=_axis(f"integers >= {minimum}", _is_int(minimum)))


@attrs.frozen(kw_only=True)
class Grid:
    """What to benchmark. Option axes left unset (``None``) use each recipe's default."""

    stacks: tuple[Spec, ...] = attrs.field(converter=_specs("stack"), validator=_axis("stack names", lambda v: isinstance(v, Spec)))
    budgets: tuple[int, ...] | None = _option_axis()
    chunk_sizes: tuple[int, ...] | None = _option_axis()
    gammas: tuple[int, ...] | None = _option_axis()
    gamma1s: tuple[int, ...] | None = _option_axis(minimum=0)  # a middle level's γ; 0: it drafts nothing and decodes alone
    gamma2s: tuple[int, ...] | None = _option_axis()
    trees: tuple[str, ...] | None = attrs.field(  # token-tree specs such as binary:3 (the sequoia plugin's stacks)
        default=None, converter=_as_tuple, validator=_axis("tree specs such as \"binary:3\"", lambda v: isinstance(v, str) and bool(v.strip())))
    policies: tuple[str, ...] | None = attrs.field(  # registered cache policies by name (stacks with a policy option: hierarchical, self-speculative)
        default=None, converter=_as_tuple, validator=_axis("cache policy names such as \"h2o\"", lambda v: isinstance(v, str) and bool(v.strip())))
    temperatures: tuple[float, ...] = attrs.field(default=(0.0,), converter=_floats, validator=_axis("numbers >= 0", _is_temperature))
    context_lengths: tuple[int, ...] = attrs.field(default=(2048,), converter=_as_tuple, validator=_axis("integers >= 1", _is_int(1)))
    tasks: tuple[Spec, ...] = attrs.field(default=("prose",), converter=_specs("task"), validator=_check_tasks)
    seeds: tuple[int, ...] = attrs.field(default=(0,), converter=_as_tuple, validator=_axis("integers >= 0", _is_int(0)))
    max_new_tokens: int = attrs.field(default=64, validator=_scalar("an integer >= 1", _is_int(1)))
    top_p: float = attrs.field(default=1.0, validator=_scalar("a number in (0, 1]", lambda v: _is_temperature(v) and 0 < v <= 1))
    top_k: int | None = attrs.field(default=None, validator=_scalar("an integer >= 1 or absent", _is_int(1), allow_none=True))
    coupled: bool = attrs.field(default=False, validator=_scalar("true or false", lambda v: isinstance(v, bool)))  # SamplingConfig.coupled
    dtype: str = attrs.field(default="float32", validator=_scalar(f"one of {', '.join(DTYPES)}", lambda v: v in DTYPES))
    threads: int | None = attrs.field(default=None, validator=_scalar("an integer >= 1 or absent", _is_int(1), allow_none=True))
    device: str | None = attrs.field(default=None, validator=_device)  # the target's; None: cpu (given models: theirs)
    draft_device: str | None = attrs.field(default=None, validator=_device)  # None: the target's
    cuda_graphs: bool = attrs.field(default=True, validator=_scalar("true or false", lambda v: isinstance(v, bool)))
    widen_bf16: bool = attrs.field(default=False, validator=[_scalar("true or false", lambda v: isinstance(v, bool)),
                                                             lambda grid, _, value: widening_asked(grid.dtype, value)])  # HFCausalLM.widen_bf16_products
    context: int | None = attrs.field(default=None, validator=_scalar("an integer >= 1 or absent", _is_int(1), allow_none=True))  # the target's window
    rope_scaling: str = attrs.field(default="yarn", validator=_scalar("yarn, linear, extrapolate or none", lambda v: v in ("yarn", "linear", "extrapolate", "none")))
    stop_at_eos: bool = attrs.field(default=False, validator=_scalar("true or false", lambda v: isinstance(v, bool)))
    warmup: bool = attrs.field(default=True, validator=_scalar("true or false", lambda v: isinstance(v, bool)))
    repeats: int = attrs.field(default=1, validator=_scalar("an integer >= 1", _is_int(1)))  # turns of each group (bench/runner.py)

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], source: str = "the grid") -> "Grid":
        """A grid from parsed TOML/YAML/CLI values; an unknown key or a bad value is one error line."""
        if not isinstance(data, Mapping):
            raise SpecstackError(f"{source} must be a table of grid keys; got {type(data).__name__}")
        allowed = [f.name for f in attrs.fields(cls)]
        unknown = sorted(set(data) - set(allowed))
        if unknown:
            raise SpecstackError(f"unknown grid key {unknown[0]!r} in {source}; allowed: {', '.join(allowed)}")
        if "stacks" not in data:
            raise SpecstackError(f"{source} has no 'stacks'; name at least one stack, e.g. stacks = [\"triforce\"]")
        return cls(**data)


def load_grid(path: str | Path | None = None, overrides: Mapping[str, Any] | None = None) -> Grid:
    """A grid from a TOML or YAML file, with ``overrides`` (e.g. CLI flags) replacing its keys."""
    data = dict(_read_grid_file(Path(path))) if path is not None else {}
    data.update({k: v for k, v in (overrides or {}).items() if v is not None})
    return Grid.from_mapping(data, source=f"grid file {str(path)!r}" if path is not None else "the grid")


def _read_grid_file(path: Path) -> Mapping[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise SpecstackError(f"cannot read grid file {str(path)!r}: {error.strerror}") from None
    if path.suffix.lower() in (".yaml", ".yml"):
        return _parse_yaml(text, path)
    if path.suffix.lower() == ".toml":
        return _parse_toml(text, path)
    raise SpecstackError(f"grid file {str(path)!r} has suffix {path.suffix!r}; use .toml, .yaml or .yml")


def _parse_toml(text: str, path: Path) -> Mapping[str, Any]:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        try:
            import tomli as tomllib
        except ImportError:
            raise SpecstackError(f"grid file {str(path)!r} is TOML, which needs tomli on Python 3.10 (pip install tomli)") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise SpecstackError(f"grid file {str(path)!r} is not valid TOML: {error}") from None


def _parse_yaml(text: str, path: Path) -> Mapping[str, Any]:
    try:
        import yaml
    except ImportError:
        raise SpecstackError(f"grid file {str(path)!r} is YAML, which needs PyYAML (pip install pyyaml); or write it as TOML") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise SpecstackError(f"grid file {str(path)!r} is not valid YAML: {' '.join(str(error).split())}") from None
    return {} if data is None else data


# -- points -------------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class Point:
    """One run: a stack with its options, on one task prompt, with one sampling setup and seed."""

    stack: str
    options: tuple[tuple[str, Any], ...]
    task: Spec
    context_length: int
    temperature: float
    top_p: float
    top_k: int | None
    seed: int
    max_new_tokens: int
    dtype: str
    stop_at_eos: bool
    model: str  # identifies the models, so two model sets never share ids in one output directory
    baseline: str | None  # the stack this point's speedup is measured against (None: not known)
    device: str = "cpu"  # the target's
    draft_device: str | None = "cpu"  # None: no draft
    cuda_graphs: bool = True
    coupled: bool = False  # SamplingConfig.coupled: every stack's sampled text is autoregressive decoding's of the seed
    widen_bf16: bool = False  # the models' bf16 products widened to float32 (HFCausalLM.widen_bf16_products)

    def config(self) -> dict[str, Any]:
        return {
            "stack": self.stack, "options": dict(self.options), "task": self.task.name, "task_options": dict(self.task.options),
            "context_length": self.context_length, "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
            "seed": self.seed, "max_new_tokens": self.max_new_tokens, "dtype": self.dtype, "stop_at_eos": self.stop_at_eos,
            "model": self.model, "device": self.device, "draft_device": self.draft_device, "cuda_graphs": self.cuda_graphs,
            **({"coupled": True} if self.coupled else {}), **({"widen_bf16": True} if self.widen_bf16 else {}),
        }

    @property
    def id(self) -> str:
        return _digest(_identity(self.config()))

    @property
    def group(self) -> str:
        """Points of one group share a prompt, sampling, seed and devices: one baseline run serves them all."""
        return _digest({k: v for k, v in _identity(self.config()).items() if k not in ("stack", "options")})

    @property
    def label(self) -> str:
        return label(self.stack, dict(self.options))

    def baseline_point(self) -> "Point":
        return attrs.evolve(self, stack=self.baseline, options=(), baseline=self.baseline)


def _identity(config: Mapping[str, Any]) -> dict[str, Any]:
    """What a point's id hashes: its configuration, with ``device``, ``draft_device`` and
    ``cuda_graphs`` only where they differ from a run on the CPU (so the ids of records written before
    these keys existed stay valid, and a CUDA run never takes a CPU run's id)."""
    devices = (config["device"], config["draft_device"])
    same = {"device": config["device"] == "cpu", "draft_device": config["draft_device"] in (None, config["device"]),
            "cuda_graphs": config["cuda_graphs"] or all(d in (None, "cpu") for d in devices)}
    return {k: v for k, v in config.items() if not same.get(k, False)}


def _digest(config: Mapping[str, Any]) -> str:
    return hashlib.sha1(json.dumps(config, sort_keys=True).encode()).hexdigest()[:16]


def expand(grid: Grid, catalog, model: str, *, device: str = "cpu", draft_device: str | None = None) -> list[list[Point]]:
    """The grid's points in groups (one per task, context length, temperature and seed), each
    group led by the baselines its points are measured against; no point appears twice.
    ``device`` and ``draft_device`` (``None``: no draft) say where the models run: the model source knows."""
    groups = []
    for task, context, temperature, seed in itertools.product(grid.tasks, grid.context_lengths, grid.temperatures, grid.seeds):
        common = dict(task=task, context_length=context, temperature=temperature, top_p=grid.top_p, top_k=grid.top_k, seed=seed,
                      max_new_tokens=grid.max_new_tokens, dtype=grid.dtype, stop_at_eos=grid.stop_at_eos, model=model,
                      device=device, draft_device=draft_device, cuda_graphs=grid.cuda_graphs, coupled=grid.coupled,
                      widen_bf16=grid.widen_bf16)
        points = [Point(stack=spec.name, options=options, baseline=catalog.baseline_of(spec.name), **common)
                  for spec in grid.stacks for options in _option_sets(grid, spec, catalog)]
        groups.append(_unique([p.baseline_point() for p in points if p.baseline] + points))
    return groups


def crossed_axes(grid: Grid, spec: Spec, catalog) -> list[Axis]:
    """The option axes ``grid`` sets that ``spec``'s stack has and does not fix (none for an unknown stack)."""
    known, fixed = catalog.options_of(spec.name), dict(spec.options)
    return [axis for axis in OPTION_AXES if getattr(grid, axis.field) is not None and axis.option in known and axis.option not in fixed]


def _option_sets(grid: Grid, spec: Spec, catalog) -> list[tuple[tuple[str, Any], ...]]:
    """The fixed options of ``spec`` crossed with every axis its stack has and does not fix."""
    fixed = dict(spec.options)
    axes = crossed_axes(grid, spec, catalog)
    values = [getattr(grid, axis.field) for axis in axes]
    return [tuple(sorted({**fixed, **{a.option: v for a, v in zip(axes, combo)}}.items())) for combo in itertools.product(*values)]


def _unique(points: list[Point]) -> list[Point]:
    seen: dict[str, Point] = {}
    for point in points:
        seen.setdefault(point.id, point)
    return list(seen.values())
