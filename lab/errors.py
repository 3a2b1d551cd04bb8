"""One error type for bad input: the CLI prints its message as one line and exits non-zero."""


class LabError(ValueError):
    """Bad input or an impossible request; the message says what was wrong and what to do."""
