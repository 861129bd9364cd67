"""The one exception type users see.

Every bad input is reported as a :class:`SpecstackError` whose message is a single line naming the
bad value and what is allowed. The CLI prints it without a traceback and exits with code 2.
"""


class SpecstackError(ValueError):
    """A user-facing, one-line error about a bad value."""


def check(condition: bool, message: str) -> None:
    """Raise :class:`SpecstackError` with ``message`` unless ``condition`` holds."""
    if not condition:
        raise SpecstackError(message)
