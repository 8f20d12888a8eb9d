"""One set of command-line conventions, held by walking the Click tree (docs/cli-conventions.md): help on every
option, one type per flag, case-insensitive choices, --json wherever a result is printed, a build folder accepted
where a repository is read, and the doc's table of shared flags true to the commands that have them."""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

import click
import pytest
from click.testing import CliRunner
from support.models import deploy_tiny_cpu_repo

from pipeline.cli import main
from pipeline.cli.base import repository_in

REPO = Path(__file__).resolve().parents[1]
#: Commands that print no result: serve runs the server in the foreground until it is stopped.
NO_RESULT = {"serve"}
#: Spellings one concept had before it got one name (a test fails when one comes back).
RETIRED = {"--dtype", "--ppl-samples", "--max-samples", "--num-samples"}


def commands(group: click.Group = main, prefix: str = "") -> dict[str, click.Command]:
    ctx = click.Context(group)
    found = {}
    for name in group.list_commands(ctx):
        command = group.get_command(ctx, name)
        if isinstance(command, click.Group):
            found.update(commands(command, f"{prefix}{name} "))
        else:
            found[f"{prefix}{name}"] = command
    return found


def options(command: click.Command) -> list[click.Option]:
    return [p for p in command.params if isinstance(p, click.Option) and not p.hidden]


def flag_of(option: click.Option) -> str:
    return next(o for o in option.opts if o.startswith("--"))


def users() -> dict[str, dict[str, click.Option]]:
    by_flag = defaultdict(dict)
    for name, command in commands().items():
        for option in options(command):
            by_flag[flag_of(option)][name] = option
    return by_flag


def test_every_option_says_what_it_does():
    missing = [f"{name} {flag_of(o)}" for name, c in commands().items() for o in options(c) if not o.help]
    assert not missing, missing


def test_every_choice_is_case_insensitive():
    sensitive = [f"{name} {flag_of(o)}" for name, c in commands().items() for o in options(c)
                 if isinstance(o.type, click.Choice) and o.type.case_sensitive]
    assert not sensitive, sensitive
    result = CliRunner().invoke(main, ["plan", "smollm2-135m", "--target", "CPU", "--precision", "FP16", "--json"])
    assert result.exit_code == 0, result.output
    assert '"precision": "fp16"' in result.output


def test_every_command_that_prints_a_result_has_json():
    missing = [name for name, c in commands().items()
               if name not in NO_RESULT and "--json" not in {o for p in c.params for o in getattr(p, "opts", ())}]
    assert not missing, missing


def test_one_flag_has_one_type_everywhere():
    kinds = {flag: {(type(o.type).__name__, o.is_flag) for o in by.values()} for flag, by in users().items()}
    assert not {flag: k for flag, k in kinds.items() if len(k) > 1}
    assert not RETIRED & set(users())


def conventions_table() -> list[tuple[list[str], set[str]]]:
    text = (REPO / "docs" / "cli-conventions.md").read_text()
    rows = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 5 and cells[0].startswith("`"):
            rows.append((re.findall(r"`(-[^`]+)`", cells[0]), {c.strip() for c in cells[4].split(",")}))
    return rows


def test_the_conventions_table_names_exactly_the_commands_that_have_each_flag():
    by_flag = users()
    rows = conventions_table()
    assert len(rows) >= 15
    wrong = []
    for names, listed in rows:
        flag = next(n for n in names if n.startswith("--"))
        having = by_flag.get(flag, {})
        if set(having) != listed:
            wrong.append(f"{flag}: the table lists {sorted(listed ^ set(having))} wrongly")
        wrong += [f"{name} {flag} lacks {alias}" for name, o in having.items() for alias in names
                  if alias not in o.opts]
    assert not wrong, wrong
    shared = {flag for flag, by in by_flag.items() if len(by) >= 4}
    assert shared <= {next(n for n in names if n.startswith("--")) for names, _ in rows}


@pytest.mark.parametrize("command", ["check", "validate", "serve", "profile", "versions list"])
def test_commands_that_read_a_repository_take_a_build_folder(command, tmp_path):
    build = tmp_path / "build"
    (build / "model_repo" / "ensemble").mkdir(parents=True)
    (build / "model_repo" / "ensemble" / "config.pbtxt").write_text("")
    argument = next(p for p in commands()[command].params if p.name == "repo")
    assert argument.callback is repository_in
    assert repository_in(None, argument, build) == build / "model_repo"
    assert repository_in(None, argument, build / "model_repo") == build / "model_repo"
    assert repository_in(None, argument, tmp_path / "missing") == tmp_path / "missing"


def test_check_on_a_build_folder_checks_the_repository_inside(tiny_llama, tmp_path):
    repo = deploy_tiny_cpu_repo(tiny_llama("gqa"), tmp_path)
    build = repo.rename(tmp_path / "model_repo").parent       # tmp_path now looks like a build folder
    result = CliRunner().invoke(main, ["check", str(build)])
    assert result.exit_code == 0, result.output
    assert str(build / "model_repo") in result.output


@pytest.mark.parametrize("width", [80, 100])
def test_every_help_fits_the_terminal(width):
    wide = {}
    for name in commands():
        result = CliRunner().invoke(main, [*name.split(), "--help"], terminal_width=width)
        assert result.exit_code == 0, result.output
        wide.update({name: line for line in result.output.splitlines() if len(line) > width})
    assert not wide, wide


def test_a_long_example_is_continued_with_a_backslash_and_pastes_as_the_same_command():
    from pipeline.cli.base import fit_block

    example = "    trtpipe k8s out/fp8 -o k8s/fp8 --canary-of out/fp16 --weight 10 --name smollm2-135m-cpu-fp8 --force"
    fitted = fit_block(f"Examples:\n{example}", 60).splitlines()
    assert fitted[0] == "Examples:" and all(len(line) <= 60 for line in fitted)
    assert " ".join(line.rstrip(" \\").strip() for line in fitted[1:]) == example.strip()
    prose = fit_block("A sentence wrapped\nby hand that runs on " + "and on " * 12 + "to its end.", 50)
    assert all(len(line) <= 50 for line in prose.splitlines()) and "by hand" in prose.splitlines()[0]


def test_verbose_shows_the_traceback_of_an_unexpected_failure(monkeypatch):
    import pipeline.targets

    monkeypatch.delenv("TRTPIPE_DEBUG", raising=False)
    monkeypatch.setattr(pipeline.targets, "render_targets", lambda: 1 / 0)
    quiet = CliRunner().invoke(main, ["targets"])
    assert quiet.exit_code == 1 and "ZeroDivisionError" in quiet.output and "set TRTPIPE_DEBUG=1" in quiet.output
    monkeypatch.setenv("TRTPIPE_DEBUG", "")          # restored after the test: -v sets it for the process
    loud = CliRunner().invoke(main, ["-v", "targets"])
    assert isinstance(loud.exception, ZeroDivisionError)
