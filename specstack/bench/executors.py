"""Executors: where the groups of a grid run.

* ``local`` (default): sequentially, in this process.
* ``ray``: one Ray task per group, on an existing cluster (``address``) or a local one started with
  ``num_cpus``. Each task loads its own models and runs a whole group, so every speedup is still
  measured in one process; a job on CUDA asks Ray for the GPUs its devices name. Ray is imported
  only here, when asked for.
"""

from __future__ import annotations

import contextlib
from typing import Callable, ClassVar, Iterator

import attrs

from ..errors import SpecstackError
from ..registry import Registry
from ..run import torch_threads
from .grid import Point
from .runner import Job, Runner, run_groups

Sink = Callable[[dict], None]


@attrs.frozen(kw_only=True)
class LocalExecutor:
    name: ClassVar[str] = "local"
    in_process: ClassVar[bool] = True  # runs in this process, on this machine's devices

    @classmethod
    def create(cls, *, address: str | None, num_cpus: int | None) -> "LocalExecutor":
        if address is not None:
            raise SpecstackError(f"ray address {address!r} is only used by the ray executor; add executor='ray' (--executor ray)")
        if num_cpus is not None:
            raise SpecstackError(f"num_cpus {num_cpus!r} is only used by the ray executor; add executor='ray' (--executor ray)")
        return cls()

    def run(self, job: Job, groups: list[list[Point]], pending: set[str], sink: Sink, registry: Registry | None = None) -> None:
        with torch_threads(job.threads):
            runner = Runner.open(job, registry)
            if job.check_first:
                runner.check(groups, pending)
            for group in groups:
                for record in runner.run_group(group, pending):
                    sink(record)


@attrs.frozen(kw_only=True)
class RayExecutor:
    name: ClassVar[str] = "ray"
    in_process: ClassVar[bool] = False
    address: str | None = None
    num_cpus: int | None = None

    @classmethod
    def create(cls, *, address: str | None, num_cpus: int | None) -> "RayExecutor":
        if num_cpus is not None and (not isinstance(num_cpus, int) or num_cpus < 1):
            raise SpecstackError(f"num_cpus {num_cpus!r} is not allowed; use an integer >= 1")
        _import_ray()  # a missing Ray fails before anything runs
        return cls(address=address, num_cpus=num_cpus)

    def run(self, job: Job, groups: list[list[Point]], pending: set[str], sink: Sink, registry: Registry | None = None) -> None:
        ray = _import_ray()
        with self._cluster(ray):
            task = ray.remote(num_cpus=job.threads or 1, num_gpus=job.gpus)(run_groups)
            waiting = [task.remote(job, [group], pending & {p.id for p in group}) for group in groups]
            while waiting:
                done, waiting = ray.wait(waiting, num_returns=1)
                for record in ray.get(done[0]):
                    sink(record)

    @contextlib.contextmanager
    def _cluster(self, ray) -> Iterator[None]:
        """Use the running Ray session, or connect to ``address``, or start a local cluster (and stop it after)."""
        if ray.is_initialized():
            yield
            return
        if self.address is not None:
            ray.init(address=self.address, log_to_driver=False)
        else:
            ray.init(num_cpus=self.num_cpus, include_dashboard=False, log_to_driver=False)
        try:
            yield
        finally:
            ray.shutdown()


def _import_ray():
    try:
        import ray
    except ImportError:
        raise SpecstackError("executor 'ray' needs Ray; pip install 'ray>=2.9' (or use the local executor)") from None
    return ray


EXECUTORS = (LocalExecutor, RayExecutor)


def make_executor(name: str, *, address: str | None = None, num_cpus: int | None = None):
    for executor in EXECUTORS:
        if executor.name == name:
            return executor.create(address=address, num_cpus=num_cpus)
    raise SpecstackError(f"unknown executor {name!r}; available: {', '.join(e.name for e in EXECUTORS)}")
