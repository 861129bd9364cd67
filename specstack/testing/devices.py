"""A guard against tensors created on the default device inside specstack, for CPU-only test machines.

On a CUDA machine, a tensor made without ``device=`` (``torch.arange(k)``, ``torch.rand(k, generator=g)``)
lands on the CPU and fails, or silently syncs, when it meets the model's tensors. On a CPU-only
machine every tensor is on the same device, so nothing fails: :class:`DeviceGuard` makes such calls
fail there too.

    with DeviceGuard():
        stack.generate(prompt, 20)

What it catches: a call of a tensor factory (``torch.tensor``, ``arange``, ``zeros``, ``rand``, …; not
the ``*_like`` variants, which inherit their device) without ``device=``, or with ``device=None``
(which means the default device too), made by code in the ``specstack`` package or in a plugin package
(any top-level package named ``specstack*``). Calls from torch, transformers and tests pass.

What it cannot catch: a wrong explicit device (``device="cpu"`` where the model's device was meant)
looks the same as a right one on a machine with one device, and so does a CPU ``torch.Generator``
handed to a factory on another device, or a ``torch.from_numpy`` (always on the CPU, and not seen by
torch function modes). Those are left to the tests that run on CUDA.
"""

from __future__ import annotations

import sys

import torch
from torch.overrides import TorchFunctionMode

FACTORIES = frozenset({
    torch.tensor, torch.as_tensor, torch.arange, torch.zeros, torch.ones, torch.full, torch.empty,
    torch.empty_strided, torch.rand, torch.randn, torch.randint, torch.randperm, torch.eye,
    torch.linspace, torch.logspace, torch.tril_indices, torch.triu_indices, torch.scalar_tensor,
})
# torch.tensor(t) and torch.as_tensor(t) of a tensor t stay on t's device: nothing to name.
_COPIES = frozenset({torch.tensor, torch.as_tensor})


class DeviceMixingError(AssertionError):
    """A tensor factory was called without a device from specstack code."""


class DeviceGuard(TorchFunctionMode):
    """While active, a tensor factory called from specstack code without ``device=`` raises
    :class:`DeviceMixingError` (see the module docstring for what this can and cannot catch).

    ``sites`` lists every flagged ``file:line`` in order; with ``strict=False`` nothing is raised and
    ``sites`` is the whole list, which is how to survey a code base in one run."""

    def __init__(self, *, strict: bool = True) -> None:
        super().__init__()
        self.strict = strict
        self.sites: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in FACTORIES and kwargs.get("device") is None and not (func in _COPIES and args and isinstance(args[0], torch.Tensor)):
            site = _specstack_caller(sys._getframe(1))
            if site is not None:
                self.sites.append(site)
                if self.strict:
                    raise DeviceMixingError(f"torch.{func.__name__} called without device= at {site}")
        return func(*args, **kwargs)


def _specstack_caller(frame) -> str | None:
    """``file:line`` of the first frame outside torch, if it belongs to a specstack package; else None."""
    while frame is not None:
        module = frame.f_globals.get("__name__") or ""
        if module != "torch" and not module.startswith("torch."):
            break
        frame = frame.f_back
    if frame is None:
        return None
    top = module.partition(".")[0]
    if not top.startswith("specstack"):
        return None
    path = frame.f_code.co_filename.replace("\\", "/")
    cut = path.rfind(f"/{top}/")
    return f"{path[cut + 1:] if cut >= 0 else path}:{frame.f_lineno}"


def _example_without_device(device: torch.device | str | None = None) -> torch.Tensor:
    """A factory call from inside specstack, for the guard's own test: flagged unless ``device`` is given."""
    if device is None:
        return torch.zeros(3)
    return torch.zeros(3, device=device)
