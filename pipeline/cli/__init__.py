"""The `trtpipe` command line: a thin Click layer that parses arguments and calls the stage functions.

`base` holds the group and its error handling; `stages`, `serving` and `shipping` each register their commands
on it, imported when one of their commands is asked for (`base.COMMAND_MODULES`).
"""

from .base import main

__all__ = ["main"]
