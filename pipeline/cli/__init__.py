"""The `trtpipe` command line: a thin Click layer that parses arguments and calls the stage functions.

`base` holds the group and its error handling; each module below registers its commands on it.
"""

from . import serving, shipping, stages  # noqa: F401 -- registers the commands on `main`
from .base import main

__all__ = ["main"]
