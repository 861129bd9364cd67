"""Whether the parameters a derived structure was built from are still a module's, checked cheaply.

The lean decoder fuses each layer's products into one matrix that the parts' weights view
(:mod:`specstack.decoder`), and a compiled forward's plan holds the address of every weight, norm and
stored format it reads (:mod:`specstack.compiled_layers`). Both must notice when a parameter is
replaced, its storage swapped (``.data =``) or, for the plans, written in place, and both ask before
every forward: a few hundred parameters, with the CPU's caches cold from streaming the weights. Asked
one parameter at a time in Python loops, the two checks took 0.77-0.90 ms of the bf16 target's 7-20 ms
one-token step on the AMD Zen 4 host; a :class:`ParameterWatch` asks with a few ``map`` loops, which
run in C, in 0.59-0.68 ms. What is left is reading each tensor's address and version counter from
memory (docs/benchmarks.md, "Checking the parameters in C loops").
"""

from __future__ import annotations

import operator
from typing import Iterable

import attrs
import torch

_DATA_PTR = torch.Tensor.data_ptr
_VERSION = operator.attrgetter("_version")


@attrs.frozen(eq=False)
class ParameterWatch:
    """Parameters as they were: each one ``owner._parameters[name]``, the object it was, the address its data
    started at and, where asked and kept, its version counter (advanced by in-place writes)."""

    dicts: tuple[dict, ...]  # each owner's _parameters
    names: tuple[str, ...]
    params: tuple[torch.Tensor, ...]
    addresses: list[int]
    versions: list[int] | None  # None: not asked, or some are inference tensors, which keep none

    @classmethod
    def of(cls, entries: Iterable[tuple[torch.nn.Module, str, torch.Tensor, int]], *, versions: bool = False) -> "ParameterWatch":
        """A watch over ``entries`` (owner, name, the parameter, its address); with ``versions``, their version
        counters as they are now."""
        entries = list(entries)
        owners, names, params, addresses = zip(*entries) if entries else ((), (), (), ())
        kept = versions and not any(p.is_inference() for p in params)
        return cls(dicts=tuple(owner._parameters for owner in owners), names=tuple(names), params=tuple(params), addresses=list(addresses),
                   versions=list(map(_VERSION, params)) if kept else None)

    @classmethod
    def now(cls, owners: Iterable[tuple[torch.nn.Module, str]], *, versions: bool = False) -> "ParameterWatch":
        """A watch over the owners' parameters as they are now."""
        entries = [(owner, name, owner._parameters[name]) for owner, name in owners]
        return cls.of([(owner, name, param, param.data_ptr()) for owner, name, param in entries], versions=versions)

    def current(self) -> bool:
        """Whether every parameter is still its owner's, at the same address, unwritten where versions are watched."""
        params = list(map(dict.get, self.dicts, self.names))
        return (all(map(operator.is_, params, self.params)) and list(map(_DATA_PTR, params)) == self.addresses
                and (self.versions is None or list(map(_VERSION, params)) == self.versions))
