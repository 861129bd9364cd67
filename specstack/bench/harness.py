"""``run_grid``: expand a grid, run what ``results.jsonl`` does not hold yet, rebuild the outputs."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any, Iterator, Mapping, TextIO

import attrs

from ..errors import SpecstackError
from ..registry import Registry
from ..run import check_device
from . import report
from .executors import make_executor
from .grid import Grid, expand
from .models import devices_of, model_source
from .runner import Job, pending_in
from .stacks import Catalog

RESULTS = "results.jsonl"


@attrs.define(eq=False, kw_only=True)
class ResultsFile:
    """``results.jsonl``: one record per finished run, appended and flushed as each run ends."""

    path: Path

    def read(self) -> list[dict]:
        """Every record, the last one of each id winning; a torn last line (a killed run) is skipped."""
        if not self.path.exists():
            return []
        records: dict[str, dict] = {}
        for number, line in enumerate(self.path.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                print(f"[specstack bench] skipping unreadable line {number} of {self.path}", file=sys.stderr)
                continue
            if isinstance(record, dict) and "id" in record:
                records[record["id"]] = record
        return list(records.values())

    def append(self, record: dict) -> None:
        with self.path.open("a+b") as handle:
            torn = handle.tell() > 0 and not _ends_with_newline(handle)
            handle.write((("\n" if torn else "") + json.dumps(record) + "\n").encode("utf-8"))
            handle.flush()


def _ends_with_newline(handle) -> bool:
    handle.seek(-1, 2)
    return handle.read(1) == b"\n"


@attrs.define(eq=False, kw_only=True)
class Progress:
    """One line per finished run on stderr: count, elapsed time, ETA and what just finished."""

    total: int
    enabled: bool = True
    stream: TextIO = sys.stderr
    done: int = 0
    began: float = attrs.field(factory=time.perf_counter)

    def start(self, skipped: int) -> None:
        self._say(f"{self.total} runs to do" + (f" ({skipped} already in {RESULTS})" if skipped else ""))

    def advance(self, record: dict) -> None:
        self.done += 1
        elapsed = time.perf_counter() - self.began
        eta = elapsed / self.done * (self.total - self.done)
        outcome = f"{record['tokens_per_second']:.1f} tok/s" if record["status"] == "ok" and record.get("tokens_per_second") else record["status"]
        self._say(f"{self.done}/{self.total} runs, {_clock(elapsed)} elapsed, ETA {_clock(eta)} | {record['label']} "
                  f"{record['task']} ctx={record['context_length']} T={record['temperature']} seed={record['seed']}: {outcome}")

    def _say(self, text: str) -> None:
        if self.enabled:
            print(f"[specstack bench] {text}", file=self.stream, flush=True)


def _clock(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"


@attrs.frozen(kw_only=True)
class Table:
    """What :func:`run_grid` returns: every record of the output directory, and how many runs this call executed."""

    rows: list[dict]
    out: Path
    executed: int

    @property
    def ok(self) -> list[dict]:
        return report.ok(self.rows)

    @property
    def errors(self) -> list[dict]:
        return [r for r in self.rows if r.get("status") != "ok"]

    def to_markdown(self) -> str:
        return report.summary_markdown(self.rows)

    def __len__(self) -> int:
        return len(self.rows)

    def __iter__(self) -> Iterator[dict]:
        return iter(self.rows)

    def _repr_markdown_(self) -> str:  # notebooks render the table
        return self.to_markdown()


def run_grid(grid: Grid | Mapping[str, Any], out: str | Path, *, models: Any = None, registry: Registry | None = None,
             executor: str = "local", ray_address: str | None = None, num_cpus: int | None = None, progress: bool = True,
             check_first: bool = False) -> Table:
    """Run every point of ``grid`` not yet in ``out/results.jsonl``; rebuild CSV, report and plots.

    ``models``: ``None`` loads the embedded default in ``grid.dtype`` on ``grid.device`` (the draft
    on ``grid.draft_device``); or ``(target, draft, tokenizer)``; or a model source such as
    :class:`~specstack.bench.models.SyntheticModels`. A run's bad input (``triforce:gamma1=-1``) is recorded as
    its failure and the grid goes on; with ``check_first`` (the command line's way) the local executor raises the
    first such error as one line once the models are loaded, before anything runs (``Runner.check``).
    """
    grid = grid if isinstance(grid, Grid) else Grid.from_mapping(grid)
    runner = make_executor(executor, address=ray_address, num_cpus=num_cpus)
    if runner.in_process:  # a missing GPU fails before anything runs (a Ray worker checks its own)
        _check_devices(grid.device, grid.draft_device)
    source = model_source(models, grid)
    device, draft_device = devices_of(source)
    if runner.in_process:
        _check_devices(device, draft_device)
    groups = expand(grid, Catalog(registry=registry or Registry.create()), source.label, device=device, draft_device=draft_device)
    results = ResultsFile(path=_out_dir(out) / RESULTS)
    done = {r["id"]: r for r in results.read()}
    pending = pending_in(groups, done)
    bar = Progress(total=len(pending), enabled=progress)
    bar.start(skipped=sum(len(g) for g in groups) - len(pending))

    def sink(record: dict) -> None:
        results.append(record)
        bar.advance(record)

    job = Job(models=source, warmup=grid.warmup, threads=grid.threads, repeats=grid.repeats, cuda_graphs=grid.cuda_graphs,
              widen_bf16=grid.widen_bf16, entry_points=registry is None, check_first=check_first and runner.in_process)
    runner.run(job, [g for g in groups if any(p.id in pending for p in g)], pending, sink, registry=registry)
    return Table(rows=write_outputs(results.path.parent), out=results.path.parent, executed=bar.done)


def _check_devices(*devices: str | None) -> None:
    for device in devices:
        if device is not None:
            check_device(device)


def write_outputs(out: str | Path) -> list[dict]:
    """Rebuild ``results.csv``, ``report.md`` and the plots from every record in ``out``."""
    out = Path(out)
    records = ResultsFile(path=out / RESULTS).read()
    report.write_csv(records, out / "results.csv")
    report.write_report(records, out / "report.md", report.draw_plots(records, out))
    return records


def _out_dir(out: str | Path) -> Path:
    path = Path(out)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise SpecstackError(f"cannot create output directory {str(path)!r}: {error.strerror}") from None
    return path
