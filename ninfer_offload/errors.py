"""User-facing errors: one line with the cause and the remedy, never a traceback."""


class NinferError(Exception):
    """Base of every error the CLI reports as `error: <message>` with exit code 2."""
