"""Registers ``specstack train`` through the ``specstack_commands`` hook."""

from __future__ import annotations

from specstack.hookspecs import hookimpl


@hookimpl
def specstack_commands() -> list:
    from .command import TrainCommand

    return [TrainCommand()]
