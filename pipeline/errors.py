"""User-facing errors: one clear message and exit status 2, never a traceback."""


class UserError(Exception):
    """Bad input or usage. The CLI prints the message and exits with status 2."""

    exit_code = 2


class NotImplementedStage(UserError):
    """A stage of the command-line contract that this build does not provide yet."""

    def __init__(self, command: str):
        super().__init__(f"`trtpipe {command}` is not implemented yet in this version of trtpipe.")
