"""The one exception type for user mistakes."""


class UsageError(Exception):
    """A user mistake: reported as one line, exit code 2, no traceback."""
