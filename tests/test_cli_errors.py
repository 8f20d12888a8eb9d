"""The command group's exit statuses (pipeline/cli/base.py): 2 for the user's mistakes, 130 for Ctrl-C, also when
the interrupt surfaced as another error on the way."""

from __future__ import annotations

import os
import signal

from click.testing import CliRunner

from pipeline.cli import base, main
from pipeline.errors import UserError


def test_the_interrupt_wins_over_the_error_it_became():
    previous = signal.getsignal(signal.SIGINT)
    try:
        signal.signal(signal.SIGINT, signal.default_int_handler)

        @main.command("raise-after-ctrl-c", hidden=True)
        def raise_after_ctrl_c():
            try:
                os.kill(os.getpid(), signal.SIGINT)   # trtpipe's handler records it and raises KeyboardInterrupt
            except KeyboardInterrupt as interrupt:
                raise UserError("install trtpipe[serve]") from interrupt   # ... which an import turned into this

        try:
            result = CliRunner().invoke(main, ["raise-after-ctrl-c"])
        finally:
            main.commands.pop("raise-after-ctrl-c")
        assert result.exit_code == 130 and "interrupted" in result.output
        assert "install trtpipe[serve]" not in result.output
        plain = CliRunner().invoke(main, ["plan", "nosuchmodel-xyz", "--target", "cpu", "--precision", "fp8"])
        assert plain.exit_code == 2 and not base.INTERRUPTED     # the flag is per invocation
    finally:
        signal.signal(signal.SIGINT, previous)
