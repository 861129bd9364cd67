"""Running the points of a group in one process, and turning each run into a JSON record.

A group shares one prompt, sampling setup and seed. Its baselines (``autoregressive`` for the
recipes, ``hf-generate`` for the HF baselines) run first and their measurements are kept for the
group, so every speedup compares two runs of this process on identical input. A baseline whose
record already exists is measured again (and not recorded twice) when the group still has work.
With ``repeats`` N > 1 the group then runs N - 1 more turns, each its baselines and then its other
points again, and a point's speedup is the median of its N turns, each against the baselines of its own
turn: the host's drift between turns cancels, where one pass can rank two stacks only as far apart as
that drift.
"""

from __future__ import annotations

import importlib.metadata
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping

import attrs
import torch

from ..errors import SpecstackError
from ..model import check_window
from ..registry import Registry
from ..run import use_cuda_graphs, widen_bf16
from ..sampling import SamplingConfig
from ..speedup import measured_speedup, median_speedup
from .grid import Point
from .models import ModelSource, Models, device_of, devices_of
from .stacks import Catalog, Measurement, RunSetup, SharedPrefill
from .tasks import Books, Prompt, task_by_name


@attrs.frozen(kw_only=True)
class Job:
    """What a process needs to run groups; picklable, so a Ray worker can build its own runner."""

    models: ModelSource
    warmup: bool = True
    threads: int | None = None
    repeats: int = 1  # turns of each group (module docstring)
    cuda_graphs: bool = True  # HFCausalLM.cuda_graphs of every transformers model
    widen_bf16: bool = False  # the target's bf16 products widened (HFCausalLM.widen_bf16_products)
    entry_points: bool = True  # load plugin stack recipes in workers too
    check_first: bool = False  # Runner.check before any group runs: a bad run's input error is raised, not recorded

    @property
    def gpus(self) -> int:
        """GPUs a process of this job must see: enough for the highest CUDA index its models name."""
        devices = [torch.device(d) for d in devices_of(self.models) if d is not None]
        return max((1 + (d.index or 0) for d in devices if d.type == "cuda"), default=0)


@attrs.frozen(kw_only=True)
class Failure:
    """A run that did not produce a measurement: one line, and whether the input was at fault."""

    error: str
    kind: str  # "input" (a SpecstackError) or "crash" (anything else)

    @classmethod
    def of(cls, error: Exception) -> "Failure":
        if isinstance(error, SpecstackError):
            return cls(error=_one_line(str(error)), kind="input")
        return cls(error=_one_line(f"{type(error).__name__}: {error}"), kind="crash")


def _one_line(text: str) -> str:
    return " ".join(text.split())[:500]


@attrs.define(eq=False, kw_only=True)
class Runner:
    """Models, stacks, tokenized books and the environment of this process."""

    models: Models
    catalog: Catalog
    books: Books
    environment: dict[str, Any]
    warmup: bool = True
    repeats: int = 1  # turns of each group (module docstring)
    _warm: set[str] = attrs.field(factory=set)

    @classmethod
    def open(cls, job: Job, registry: Registry | None = None) -> "Runner":
        models = job.models.load()
        use_cuda_graphs([models.target, models.draft], job.cuda_graphs)
        widen_bf16([models.target], job.widen_bf16)
        catalog = Catalog(registry=registry or Registry.create(entry_points=job.entry_points))
        return cls(models=models, catalog=catalog, books=Books(models.tokenizer), environment=environment(models), warmup=job.warmup,
                   repeats=job.repeats)

    def check(self, groups: Iterable[list[Point]], pending: set[str]) -> None:
        """The first input error a pending run would meet before its first forward (options its stack refuses, as in
        ``triforce:gamma1=-1``; a budget beyond its context; a needle prompt too short for its needle), raised as one
        line before any group runs (``Job.check_first``): the run itself would meet it only after its group's
        baselines. Other faults (a plugin's crash) stay for the run to record."""
        seen: set[str] = set()  # a prompt is made once per task, length and seed; a stack built once per options and sampling
        for point in (p for group in groups for p in group if p.id in pending):
            try:
                self._check_one(point, seen)
            except SpecstackError as error:
                raise SpecstackError(f"run {point.label!r}: {error}") from None
            except Exception:  # noqa: BLE001 - not the input's fault: the run records it
                continue

    def _check_one(self, point: Point, seen: set[str]) -> None:
        _check_point(point, self.models.target)
        if _first_time(seen, ("prompt", point.task, point.context_length, point.seed)):
            self._make_prompt(point)
        setup = self._setup(point, ())
        if _first_time(seen, ("stack", point.stack, point.options, setup.sampling)):
            self.catalog.get(point.stack).check(setup, dict(point.options))

    def run_group(self, points: list[Point], pending: set[str]) -> Iterator[dict]:
        """A record for every pending point of the group, in order (baselines first)."""
        todo = [p for p in points if p.id in pending]
        if not todo:
            return
        prompt = self._prompt(todo[0])
        prefill = None if isinstance(prompt, Failure) else SharedPrefill(prompt=prompt.tokens)
        needed = {p.baseline for p in todo if p.baseline}
        measured: dict[str, Measurement | Failure] = {}
        baselines: list[Point] = []
        waiting: list[tuple[Point, dict]] = []  # baselines' records: they wait for the check at the group's end
        turning: list[tuple[Point, dict]] = []  # the others' records, where more turns follow
        for point in points:
            if point.id not in pending and not (point.stack in needed and not point.options):
                continue
            outcome = prompt if isinstance(prompt, Failure) else self._measure(point, prompt, prefill)
            is_baseline = point.stack in needed and not point.options
            if is_baseline:
                measured[point.stack] = outcome
                baselines.append(point)
            if point.id in pending:
                record = self._record(point, prompt, outcome, measured.get(point.baseline))
                if is_baseline:
                    waiting.append((point, record))
                elif self.repeats > 1 and isinstance(outcome, Measurement):
                    turning.append((point, {**record, "speedups": [record["speedup"]]}))
                else:
                    yield record
        for _ in range(self.repeats - 1 if turning else 0):
            turn = {point.stack: self._measure(point, prompt, prefill) for point in baselines}
            for point, record in turning:
                _add_turn(record, self._measure(point, prompt, prefill), turn.get(point.baseline), greedy=self._one_text(point))
        yield from (record for _, record in turning)
        for point, record in waiting:
            yield self._with_drift(point, record, prompt, prefill, measured_since=len(todo) > len(waiting))

    def _with_drift(self, point: Point, record: dict, prompt: Prompt | Failure, prefill: SharedPrefill | None, *, measured_since: bool) -> dict:
        """A baseline's record with ``baseline_again``: the baseline measured once more at its group's end, where other
        runs came between (``None`` otherwise), and ``drift``, its decode speed then over first. The group's speedups
        are against the first measurement; a drift far from 1 says the host changed speed while they ran."""
        first = record.get("decode_tokens_per_second")
        if not measured_since or record["status"] != "ok" or not first or isinstance(prompt, Failure):
            return {**record, "baseline_again": None}
        again = self._measure(point, prompt, prefill)
        speed = again.decode_tokens_per_second if isinstance(again, Measurement) else None
        return {**record, "baseline_again": None if speed is None else {"decode_tokens_per_second": speed, "drift": speed / first}}

    def _one_text(self, point: Point) -> bool:
        """Whether the run must write its baseline's text: greedy, or coupled sampling by a stack that couples."""
        return point.temperature == 0 or (point.coupled and self.catalog.get(point.stack).couples)

    def _prompt(self, point: Point) -> Prompt | Failure:
        try:
            return self._make_prompt(point)
        except Exception as error:  # noqa: BLE001 - recorded, the grid goes on
            return Failure.of(error)

    def _make_prompt(self, point: Point) -> Prompt:
        return task_by_name(point.task.name).prompt(self.books, point.context_length, point.seed, dict(point.task.options))

    def _measure(self, point: Point, prompt: Prompt, prefill: SharedPrefill | None = None) -> Measurement | Failure:
        try:
            stack = self.catalog.get(point.stack)
            _check_point(point, self.models.target)
            run = attrs.evolve(self._setup(point, prompt.tokens), prefill=prefill)
            self._warm_up(stack, run)
            devices = self.models.cuda_devices
            self.models.synchronize()  # the warm-up's work is done before the clock starts
            _reset_cuda_peak(devices)
            measured = stack.measure(run, dict(point.options))
            return attrs.evolve(measured, peak_cuda_mb=_cuda_peak_mb(devices))
        except Exception as error:  # noqa: BLE001 - recorded, the grid goes on
            return Failure.of(error)

    def _setup(self, point: Point, prompt: tuple[int, ...]) -> RunSetup:
        sampling = SamplingConfig(temperature=point.temperature, top_p=point.top_p, top_k=point.top_k, coupled=point.coupled)
        stops = self.models.stop_tokens if point.stop_at_eos else ()
        return RunSetup(models=self.models, registry=self.catalog.registry, sampling=sampling, stop_tokens=stops,
                        prompt=prompt, max_new_tokens=point.max_new_tokens, seed=point.seed)

    def _warm_up(self, stack, run: RunSetup) -> None:
        """One short untimed run per stack family, so no timed run pays for first-call set-up."""
        if not self.warmup or stack.family in self._warm:
            return
        self._warm.add(stack.family)
        try:
            stack.warm(run.short())
        except Exception:  # noqa: BLE001 - the timed run will report the problem
            pass

    def _record(self, point: Point, prompt: Prompt | Failure, outcome: Measurement | Failure,
                reference: Measurement | Failure | None) -> dict:
        head = {"id": point.id, "group": point.group, "label": point.label, **point.config(), "baseline": point.baseline}
        tail = {"environment": self.environment, "git_revision": self.environment["git_revision"]}
        if isinstance(outcome, Failure):
            return {**head, "status": "error", "error": outcome.error, "error_kind": outcome.kind, **tail}
        return {**head, "status": "ok", **metrics(outcome, reference, prompt, self.books, greedy=self._one_text(point)), **tail}


def _first_time(seen: set[str], key: tuple) -> bool:
    """Whether ``key`` is new to ``seen`` (which then holds it)."""
    if repr(key) in seen:
        return False
    seen.add(repr(key))
    return True


def _check_point(point: Point, target: Any) -> None:
    """Failures known before any forward pass: a budget beyond the context, a window too small."""
    budget = dict(point.options).get("budget")
    if isinstance(budget, int) and budget > point.context_length:
        raise SpecstackError(f"budget {budget} is larger than the {point.context_length}-token context; use a budget of at most {point.context_length}")
    check_window(target, point.context_length + point.max_new_tokens,
                 f"a {point.context_length}-token context plus {point.max_new_tokens} new tokens")


# -- metrics ------------------------------------------------------------------------------------


def metrics(run: Measurement, reference: Measurement | Failure | None, prompt: Prompt, books: Books, *, greedy: bool) -> dict[str, Any]:
    """The numbers of one successful run (see docs/bench.md for each field)."""
    n = len(run.tokens)
    text = books.decode(run.tokens)
    return {
        "new_tokens": n,
        "decode_seconds": run.decode_seconds,
        "prefill_seconds": run.prefill_seconds,
        "total_seconds": run.total_seconds,
        "timing": run.timing,
        "tokens_per_second": n / run.timed_seconds if run.timed_seconds > 0 else None,
        "decode_tokens_per_second": run.decode_tokens_per_second,
        "speedup": _speedup(run, reference),
        "identical_to_baseline": _identical(run, reference) if greedy else None,
        "levels": [level.as_dict() for level in run.levels],
        "time_split": _time_split(run),
        "peak_rss_mb": peak_rss_mb(),
        "peak_cuda_mb": run.peak_cuda_mb,
        "accuracy": prompt.score(text),
        "task_info": dict(prompt.info),
        "notes": dict(run.notes),
        "text": text,
        "tokens": list(run.tokens),
    }


def _speedup(run: Measurement, reference: Measurement | Failure | None) -> float | None:
    """Baseline seconds per token / this run's seconds per token, on the same kind of timing."""
    if not isinstance(reference, Measurement) or reference.timing != run.timing or not run.tokens or not reference.tokens:
        return None
    if run.timed_seconds <= 0:
        return None
    return measured_speedup(reference.timed_seconds, len(reference.tokens), run.timed_seconds, len(run.tokens))


def _add_turn(record: dict, run: Measurement | Failure, reference: Measurement | Failure | None, *, greedy: bool) -> None:
    """One more turn of a point (the runner's ``repeats``): its speedup against the baseline of the same turn joins
    ``speedups`` (None where either run failed), ``speedup`` becomes their median, and a run that must write its
    baseline's text is identical only if it did so in every turn."""
    speedup = _speedup(run, reference) if isinstance(run, Measurement) else None
    record["speedups"].append(speedup)
    record["speedup"] = median_speedup(record["speedups"])
    if greedy and record.get("identical_to_baseline") is not None:
        record["identical_to_baseline"] = bool(record["identical_to_baseline"] and isinstance(run, Measurement) and _identical(run, reference))


def _identical(run: Measurement, reference: Measurement | Failure | None) -> bool | None:
    """Is the output token for token the baseline's? (asked of greedy runs only)"""
    if not isinstance(reference, Measurement):
        return None
    return run.tokens == reference.tokens


def _time_split(run: Measurement) -> dict[str, float] | None:
    """Decode seconds spent drafting (forwards of every level below the top), verifying (the top level's forwards),
    in the levels' bookkeeping (sampling, verification, a model-free drafter's drafting: ``LevelStats.bookkeeping_seconds``),
    re-gathering retrieval views (``LevelStats.gather_seconds``) and on the rest (the decoding loop around the levels)."""
    if not run.levels or run.decode_seconds is None:
        return None
    drafting = sum(level.forward_seconds for level in run.levels[:-1])
    verifying = run.levels[-1].forward_seconds
    bookkeeping = sum(level.bookkeeping_seconds for level in run.levels)
    gathering = sum(level.gather_seconds for level in run.levels)
    return {"drafting_seconds": drafting, "verifying_seconds": verifying, "bookkeeping_seconds": bookkeeping, "gathering_seconds": gathering,
            "rest_seconds": max(0.0, run.decode_seconds - drafting - verifying - bookkeeping - gathering)}


def peak_rss_mb() -> float | None:
    """The process's high-water mark of resident memory so far."""
    try:
        import resource  # Unix only
    except ImportError:
        return None
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return round(rss / 2**20 if sys.platform == "darwin" else rss / 2**10, 1)


def _reset_cuda_peak(devices: Iterable[torch.device]) -> None:
    for device in devices:
        torch.cuda.reset_peak_memory_stats(device)


def _cuda_peak_mb(devices: tuple[torch.device, ...]) -> float | None:
    """Peak CUDA memory allocated since :func:`_reset_cuda_peak`, summed over the models' devices
    (``None`` on the CPU)."""
    if not devices:
        return None
    return round(sum(torch.cuda.max_memory_allocated(device) for device in devices) / 2**20, 1)


# -- environment --------------------------------------------------------------------------------


def environment(models: Models) -> dict[str, Any]:
    target = models.target
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": _version("transformers"),
        "specstack": _version("specstack"),
        "platform": platform.platform(),
        "machine": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "dtype": str(getattr(target, "dtype", None) or "n/a").removeprefix("torch."),
        "device": device_of(target),
        "draft_device": None if models.draft is None else device_of(models.draft),
        **({"gpu": ", ".join(dict.fromkeys(torch.cuda.get_device_name(d) for d in models.cuda_devices))} if models.cuda_devices else {}),
        "target": str(getattr(target, "name", None) or type(target).__name__),
        "git_revision": git_revision(),
    }


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def git_revision() -> str | None:
    """``git rev-parse HEAD`` of the checkout specstack runs from, or ``None`` outside one."""
    try:
        done = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() or None if done.returncode == 0 else None


def run_groups(job: Job, groups: Iterable[list[Point]], pending: set[str]) -> list[dict]:
    """Run groups in a fresh runner and return their records (the body of one Ray task)."""
    if job.threads:
        torch.set_num_threads(job.threads)
    runner = Runner.open(job)
    return [record for group in groups for record in runner.run_group(group, pending)]


def pending_in(groups: Iterable[list[Point]], done: Mapping[str, Any]) -> set[str]:
    return {p.id for group in groups for p in group if p.id not in done}
