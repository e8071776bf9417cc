"""The one exception type that maceq raises for bad input.

Every user-facing failure (a bad model, a bad image folder, a bad config key)
is a :class:`MaceqError` with a one-line message that names the file, node or
key at fault. The CLIs catch it, print ``error: <message>`` and exit with 2.
"""


class MaceqError(Exception):
    """Bad input or an unsupported construct, explained in one line."""


class UndefinedOnDevice(MaceqError):
    """The device's result for this input is undefined (its kernel writes out of bounds): no model
    that reaches it may be written."""


def one_line(text: object) -> str:
    """``text`` on one line: each line break (any that ``str.splitlines`` knows) becomes the two
    characters ``\\n``, so a name read from a file cannot break a one-line message."""
    text = str(text)
    lines = text.splitlines()
    return text if len(lines) <= 1 and not text.endswith(("\n", "\r")) else "\\n".join(lines)
