"""User-facing errors: one clear message and exit status 2, never a traceback."""


class UserError(Exception):
    """Bad input or usage. The CLI prints the message and exits with status 2."""

    exit_code = 2

