"""The exported conformance suite, run over every registered component (built-ins and the
installed plugin distributions)."""

from specstack.testing.conformance import *  # noqa: F401,F403
