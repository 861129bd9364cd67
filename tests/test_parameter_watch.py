"""ParameterWatch: what the lean decoder and the compiled layers' plans ask before every forward."""

from __future__ import annotations

import torch

from specstack.parameter_watch import ParameterWatch


def modules() -> tuple[torch.nn.Linear, torch.nn.LayerNorm]:
    torch.manual_seed(0)
    return torch.nn.Linear(4, 3), torch.nn.LayerNorm(4)


def test_a_watch_notices_a_replaced_parameter_new_storage_and_a_removed_one() -> None:
    linear, norm = modules()
    owners = [(linear, "weight"), (linear, "bias"), (norm, "weight")]
    watch = ParameterWatch.now(owners)
    assert watch.current()
    linear.weight = torch.nn.Parameter(linear.weight.detach().clone())  # another parameter
    assert not watch.current()
    watch = ParameterWatch.now(owners)
    with torch.no_grad():
        norm.weight.data = norm.weight.detach().clone()  # the same parameter, new storage
    assert not watch.current()
    watch = ParameterWatch.now(owners)
    linear.bias = None  # gone
    assert not watch.current()


def test_a_watch_asked_for_versions_notices_an_in_place_write_and_one_that_was_not_does_not() -> None:
    linear, _ = modules()
    owners = [(linear, "weight"), (linear, "bias")]
    versioned, plain = ParameterWatch.now(owners, versions=True), ParameterWatch.now(owners)
    with torch.no_grad():
        linear.weight.mul_(2.0)  # same object, same storage, written
    assert not versioned.current() and plain.current()


def test_a_watch_of_entries_compares_with_the_addresses_it_was_given() -> None:
    """The lean decoder watches its fused parts as they were fused, not as they are when it first asks."""
    linear, _ = modules()
    weight = linear.weight
    watch = ParameterWatch.of([(linear, "weight", weight, weight.data_ptr())])
    with torch.no_grad():
        linear.weight.data = linear.weight.detach().clone()
    assert not watch.current()
    assert ParameterWatch.of([]).current()
