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


def whole_number(value: object, name: str, minimum: int = 1) -> int:
    """``value`` (an int, or the text of one, as a flag gives it) as an int of at least ``minimum``; otherwise
    one :class:`SpecstackError` line naming ``name``, the value and what is allowed."""
    try:
        number = int(value) if isinstance(value, (int, str)) and not isinstance(value, bool) else None
    except ValueError:
        number = None
    if number is None or number < minimum:
        raise SpecstackError(f"{name} {value!r} is not allowed; use an integer >= {minimum}")
    return number
