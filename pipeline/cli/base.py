"""The `trtpipe` command group and what its commands share: error handling, common options.

Exit status: 0 success, 2 bad input or usage (one clear message), 1 anything else.
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import sys
import textwrap
from pathlib import Path

import click

from .. import __version__
from ..errors import UserError

#: The image the Dockerfile builds (`docker build -t trtpipe:VERSION .`), for `trtpipe k8s` and `build --k8s`.
DEFAULT_IMAGE = f"trtpipe:{__version__}"
MODEL_HELP = ("MODEL is a preset name (smollm2-135m, llama-3-8b, ...: `trtpipe models` lists them), a Hugging Face "
              "directory, a GGUF file or a hub id.")


#: Each command -> the module of this package that registers it on `main` when imported. A command's module is
#: imported only when that command runs (or help lists them all), so `trtpipe convert` does not pay for the
#: server, requests and the backends at start-up (tests/test_convert.py checks the table against the modules).
COMMAND_MODULES = {
    **dict.fromkeys(("setup", "convert", "calibrate", "eval", "export-onnx", "targets", "plan", "compile", "deploy",
                     "build"), "stages"),
    **dict.fromkeys(("sparsify", "distill"), "compress"),
    "models": "models",
    **dict.fromkeys(("check", "validate", "serve", "probe", "compare", "tune", "doctor", "profile"),
                     "serving"),
    **dict.fromkeys(("k8s", "versions", "matrix", "ci", "package", "verify", "unpack"), "shipping"),
}


#: set when SIGINT arrived: an import interrupted by Ctrl-C can surface as an ImportError (numpy's C extensions), which
#: trtpipe would otherwise report as a missing package with exit 2 (issue 25); it is reported as interrupted, 130
INTERRUPTED: list[int] = []


def watch_interrupts() -> None:
    """Record SIGINT before raising KeyboardInterrupt as Python does; left alone when SIGINT is ignored (a
    background job of a script) or handled by someone else."""
    INTERRUPTED.clear()
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        return

    def interrupted(signum, frame):
        INTERRUPTED.append(signum)
        raise KeyboardInterrupt

    try:
        signal.signal(signal.SIGINT, interrupted)
    except ValueError:   # not the main thread (a command invoked from a thread): Python's own handling stays
        pass


#: The first word of an example line in a help text (kept copy-pasteable: broken with a backslash, not re-wrapped).
COMMAND_WORDS = ("trtpipe", "kubectl", "docker", "hf", "bash", "curl", "tritonserver", "eval")


def indent_of(line: str) -> str:
    return line[:len(line) - len(line.lstrip())]


def is_command(line: str) -> bool:
    return line.split(maxsplit=1)[0] in COMMAND_WORDS if line.strip() else False


def fit_command(line: str, width: int) -> list[str]:
    """An example command longer than WIDTH, broken with `\\` continuations so it still pastes as one."""
    indent, words = indent_of(line), line.split()
    lines, current = [], indent + words[0]
    for word in words[1:]:
        if len(current) + len(word) + 3 > width:
            lines.append(current + " \\")
            current = indent + "    " + word
        else:
            current += " " + word
    return [*lines, current]


def prose_runs(lines: list[str]) -> list[list[str]]:
    """LINES cut into runs: each command line alone, and consecutive prose lines of one indent (a sentence wrapped
    by hand) together; a heading (a line ending with ':') stands alone, and a list item ('- ') starts a run."""
    runs: list[list[str]] = []
    for line in lines:
        last = runs[-1][-1] if runs else None
        joins = (last is not None and line.strip() and last.strip() and "\b" not in (line, last)
                 and not is_command(line) and not is_command(last) and indent_of(line) == indent_of(last)
                 and not last.rstrip().endswith(":") and not line.rstrip().endswith(":")
                 and not line.lstrip().startswith("- "))
        if joins:
            runs[-1].append(line)
        else:
            runs.append([line])
    return runs


def fit_block(text: str, width: int) -> str:
    """A help text's unwrapped (`\\b`) block fitted to WIDTH columns: prose re-wrapped, commands continued."""
    fitted = []
    for run in prose_runs(text.splitlines()):
        if is_command(run[0]):
            fitted += fit_command(run[0], width) if len(run[0]) > width else run
        elif any(len(line) > width for line in run):
            indent = indent_of(run[0])
            fitted += textwrap.wrap(" ".join(line.strip() for line in run), width, initial_indent=indent,
                                    subsequent_indent=indent, break_on_hyphens=False)
        else:
            fitted += run
    return "\n".join(fitted)


class TrtpipeFormatter(click.HelpFormatter):
    """Click's formatter, with the unwrapped blocks of a help text (examples, lists) fitted to the terminal too."""

    def write_text(self, text: str) -> None:
        super().write_text(fit_block(text, max(self.width - self.current_indent, 40)))


class TrtpipeContext(click.Context):
    formatter_class = TrtpipeFormatter


def fitted_help(command: click.Command) -> click.Command:
    """COMMAND (and a group's subcommands) formatting its help with `TrtpipeFormatter`."""
    command.context_class = TrtpipeContext
    for sub in getattr(command, "commands", {}).values():
        fitted_help(sub)
    return command


class TrtpipeGroup(click.Group):
    """Turns user errors into one line on stderr and exit 2, other failures into exit 1; loads each command's
    module when the command is asked for (COMMAND_MODULES); every help text fitted to the terminal."""

    context_class = TrtpipeContext

    def list_commands(self, ctx) -> list[str]:
        return sorted(set(COMMAND_MODULES) | set(self.commands))

    def get_command(self, ctx, name: str):
        if name not in self.commands and name in COMMAND_MODULES:
            importlib.import_module(f"{__package__}.{COMMAND_MODULES[name]}")
        command = super().get_command(ctx, name)
        return fitted_help(command) if command is not None else None

    def invoke(self, ctx):
        watch_interrupts()
        try:
            return super().invoke(ctx)
        except (click.exceptions.Exit, click.ClickException, click.Abort):
            raise
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            sys.exit(130)
        except Exception as exc:
            if INTERRUPTED:   # Ctrl-C, turned into another error on the way (numpy: "umath failed to import")
                click.echo("interrupted", err=True)
                sys.exit(130)
            if isinstance(exc, UserError):
                click.echo(f"error: {exc}", err=True)
                sys.exit(exc.exit_code)
            if os.environ.get("TRTPIPE_DEBUG"):
                raise
            click.echo(f"error: {type(exc).__name__}: {exc} (set TRTPIPE_DEBUG=1 for the traceback)", err=True)
            sys.exit(1)


#: The folder of a `trtpipe build` that holds its Triton repository.
BUILD_REPOSITORY = "model_repo"


def repository_in(ctx, param, value: Path | None) -> Path | None:
    """A build folder given where a repository is read stands for the repository inside it (BUILD/model_repo)."""
    if value is not None and not (value / "config.pbtxt").exists() and (value / BUILD_REPOSITORY).is_dir() \
            and not any(value.glob("*/config.pbtxt")):
        return value / BUILD_REPOSITORY
    return value


def repository_argument(required: bool = True):
    """REPO of the commands that read a Triton repository: the repository, or a build folder holding one."""
    return click.argument("repo", type=click.Path(path_type=Path), required=required, callback=repository_in)


def choice(values) -> click.Choice:
    """The one kind of choice option: matched case-insensitively (`--precision FP8` is fp8), the value passed on as
    the choice is spelt in VALUES."""
    return click.Choice(list(values), case_sensitive=False)


class Concurrency(click.ParamType):
    """--concurrency, one spelling in every command: N, or N,N,... for the commands that sweep levels (validate,
    tune); the others run one level and refuse a list."""

    name = "concurrency"

    def __init__(self, sweep: bool):
        self.sweep = sweep

    def convert(self, value, param, ctx):
        if isinstance(value, (int, tuple)):
            return value
        from ..tune.trial import parse_concurrencies

        try:
            levels = parse_concurrencies(str(value))
        except UserError:
            self.fail(f"{value!r}: whole numbers of at least 1, comma-separated", param, ctx)
        if self.sweep:
            return levels
        if len(levels) != 1:
            self.fail(f"{value!r}: this command runs one level (validate and tune sweep N,N,...)", param, ctx)
        return levels[0]


def concurrency_option(help_text: str, default=None, sweep: bool = False):
    return click.option("--concurrency", type=Concurrency(sweep), default=default, show_default=default is not None,
                        metavar="N,N,..." if sweep else "N", help=help_text)


def speculative_options(command):
    """--speculative, --draft-len and --acceptance (plan and build): pipeline/plan/speculative.py."""
    for option in reversed((
            click.option("--speculative", default=None, metavar="METHOD",
                         help="Speculative decoding: ngram (prompt lookup) or draft:MODEL (a second model with "
                              "the target's tokenizer drafts: a TensorRT-LLM checkpoint on the cpu target, a preset "
                              "or hub id for the pytorch backend on a GPU, whose speculative_config the plan "
                              "writes), lookahead[:W,N,G] (the engine path; needs --acceptance) or eagle:HEAD (an "
                              "EAGLE-3 head, a directory or hub id, on the pytorch backend; needs --acceptance). The "
                              "plan predicts the speedup at each concurrency and the most rows the server drafts "
                              "for."),
            click.option("--draft-len", type=int, default=None, metavar="K",
                         help="Drafts verified per step (default 3; 8 for prompt lookup on the cpu target, whose "
                              "drafts shrink with the match: 8 / 4 / 2 after a 3 / 2 / 1-token match)."),
            click.option("--acceptance", type=float, default=None, metavar="A",
                         help="The acceptance rate (accepted / drafted tokens) the prediction assumes; `trtpipe "
                              "validate` measures a deployment's (default 0.35 for ngram, 0.7 for draft)."),
            click.option("--drafts-per-step", type=float, default=None, metavar="D",
                         help="The drafts a step verifies on average, at most K (prompt lookup finds no match in "
                              "many steps); `trtpipe validate` measures a deployment's (default 2.2 for ngram, K "
                              "for draft)."))):
        command = option(command)
    return command


def speculative_request(speculative: str | None, draft_len: int | None, acceptance: float | None,
                        drafts_per_step: float | None = None):
    """The SpeculativeRequest the options ask for (None: no speculation); UserError for a lone --draft-len,
    --acceptance or --drafts-per-step."""
    from ..plan.speculative import SpeculativeRequest

    if speculative is None:
        if (draft_len, acceptance, drafts_per_step) != (None, None, None):
            raise UserError("--draft-len, --acceptance and --drafts-per-step go with --speculative METHOD")
        return None
    return SpeculativeRequest.parse(speculative, draft_len, acceptance, drafts_per_step)


#: Tokens generated per request by every command that sends requests (validate, compare, tune, profile).
MAX_TOKENS = 16


def max_tokens_option():
    return click.option("--max-tokens", type=click.IntRange(2, 4096), default=MAX_TOKENS, show_default=True,
                        help="Tokens generated per request.")


def json_option(what: str):
    """--json, one spelling for every command that prints a result."""
    return click.option("--json", "as_json", is_flag=True, help=f"Print {what} as JSON.")


def echo_result(result, as_json: bool) -> None:
    """A command's result: its `to_dict()` as JSON with --json, else its `summary()` for a person."""
    click.echo(json.dumps(result.to_dict(), indent=2) if as_json else result.summary())


def price_option(help_text: str = "What an hour of this deployment costs, in US dollars: the load figures then "
                 "include the cost per million output tokens."):
    """--price-per-hour, checked while the options are parsed (`pipeline.k8s.monitoring.check_price`: one line,
    exit 2)."""
    def check(ctx, param, value):
        from ..k8s.monitoring import check_price

        return check_price(value)

    return click.option("--price-per-hour", default=None, metavar="USD", callback=check, help=help_text)


def device_option(what: str):
    """--device of the stages that run the model a decoder layer at a time (one spelling for all)."""
    return click.option("--device", type=choice(["auto", "cpu", "cuda"]), default="auto", show_default=True,
                        help=f"Where {what}, one decoder layer in memory at a time (auto: CUDA when torch sees a GPU).")


def calibration_data_options(command):
    """--dataset, --text-field, --samples, --seq-len, --seed: the calibration recipe (calibrate, sparsify, distill)."""
    options = [
        click.option("--dataset", default=None,
                     help="Recipe name (news, cnn_dailymail), local .txt/.jsonl/.json/.parquet/.csv file, or a "
                          "Hugging Face dataset name in the local cache (default: the offline news recipe)."),
        click.option("--text-field", default=None, help="Field holding the text (default: the recipe's, else 'text')."),
        click.option("--samples", type=click.IntRange(min=1), default=None,
                     help="Number of calibration samples (default: the recipe's)."),
        click.option("--seq-len", type=click.IntRange(min=2), default=None,
                     help="Tokens per sample at most (default: the recipe's)."),
        click.option("--seed", type=int, default=None, help="Seed of the sample order (default: the recipe's)."),
    ]
    for option in reversed(options):
        command = option(command)
    return command


@click.group(cls=TrtpipeGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="trtpipe")
@click.option("-v", "--verbose", is_flag=True, help="On an unexpected failure, print the traceback too (as "
              "TRTPIPE_DEBUG=1 does).")
def main(verbose):
    """trtpipe: a Hugging Face causal LM to a validated Triton deployment backed by TensorRT-LLM.

    \b
    Examples:
      trtpipe build smollm2-135m --target cpu --precision fp8 -o out/smollm2
      trtpipe build llama-3-8b --target rtx4090 --precision fp8 --dry-run
    """
    if verbose:
        os.environ["TRTPIPE_DEBUG"] = "1"


def report_verification(result, as_json: bool) -> None:
    click.echo(json.dumps(result.to_dict(), indent=2) if as_json else result.summary())
    if not result.ok:
        sys.exit(1)

