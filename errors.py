"""The one exception type that maceq raises for bad input.

Every user-facing failure (a bad model, a bad image folder, a bad config key)
is a :class:`MaceqError` with a one-line message that names the file, node or
key at fault. The CLIs catch it, print ``error: <message>`` and exit with 2.
"""


class MaceqError(Exception):
    """Bad input or an unsupported construct, explained in one line."""
