"""The documentation a newcomer reads, true to the tree: every link in the README and docs/ names a file of this
repository that exists (none leaves it), docs/README.md indexes every page of docs/, every `trtpipe COMMAND --flag`
the pages show is a command of the Click tree with that flag, every repository path they name exists, and none
cites an issue or run number a reader cannot follow."""

from __future__ import annotations

import re
import shlex
from functools import cache
from pathlib import Path

import click
import pytest

from pipeline.cli import main

REPO = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def pages() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def local_links(page: Path) -> list[str]:
    return [t.split("#", 1)[0] for t in LINK.findall(page.read_text())
            if not re.match(r"[a-z][a-z0-9+.-]*:", t) and not t.startswith("#")]


def test_every_link_names_a_file_inside_the_repository():
    broken = []
    for page in pages():
        for target in local_links(page):
            resolved = (page.parent / target).resolve()
            if not resolved.is_relative_to(REPO) or not resolved.exists():
                broken.append(f"{page.relative_to(REPO)} -> {target}")
        if "../shared/" in page.read_text():   # the workplace's reference files, which a clone does not have
            broken.append(f"{page.relative_to(REPO)} names ../shared/")
    assert not broken, broken


def test_the_docs_index_names_every_page():
    indexed = set(local_links(REPO / "docs" / "README.md"))
    missing = [p.name for p in (REPO / "docs").glob("*.md") if p.name != "README.md" and p.name not in indexed]
    assert not missing, f"docs/README.md does not index {missing}"


def test_the_link_finder_sees_a_link_that_leaves_the_repository(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("see [the facts](../shared/reference/facts.md), [a site](https://example.com), [here](#top)")
    assert local_links(page) == ["../shared/reference/facts.md"]


#: What a clone does not have: the workplace's research notes, by any of the names they were cited by.
OUTSIDE_NOTES = re.compile(r"shared/reference|serving-scaling-facts|reference (?:corrections|upstream-facts)")
FACT_LABEL = re.compile(r"upstream-facts(?:\.md)? §?([A-Z]?[0-9]+(?:\.[0-9]+)?|[A-Z])\b")
TEXT_FILES = ("*.md", "*.py", "*.json", "*.toml", "Dockerfile", "*.sh", "*.yml")


def repository_texts() -> list[Path]:
    skip = {".git", ".venv", "out", "node_modules"}
    return [p for pattern in TEXT_FILES for p in REPO.rglob(pattern)
            if not skip & set(p.relative_to(REPO).parts) and p != Path(__file__)]


def fact_sections() -> set[str]:
    text = (REPO / "docs" / "upstream-facts.md").read_text()
    return set(re.findall(r"^#{2,3} ([A-Z]?[0-9]*(?:\.[0-9]+)?)\.? ", text, re.M)) - {""}


def test_no_file_sends_a_reader_to_notes_outside_the_repository():
    named = [f"{p.relative_to(REPO)}: {m.group(0)}" for p in repository_texts()
             for m in OUTSIDE_NOTES.finditer(p.read_text(errors="replace"))]
    assert not named, named


def test_every_cited_upstream_facts_section_exists():
    sections = fact_sections()
    assert {"0", "A1", "B2", "S1", "S2", "S3", "S4"} <= sections
    missing = sorted({f"{p.relative_to(REPO)}: §{label}" for p in repository_texts()
                      for label in FACT_LABEL.findall(p.read_text(errors="replace")) if label not in sections})
    assert not missing, missing


def test_the_fact_label_finder_reads_each_way_a_section_is_cited():
    text = "upstream-facts A4, docs/upstream-facts.md §S2 and upstream-facts.md K; reference/upstream-facts.md §A1"
    assert FACT_LABEL.findall(text) == ["A4", "S2", "K", "A1"]
    assert OUTSIDE_NOTES.search("see ../shared/reference/corrections.md")


# ---------------------------------------------------------------------------------------------------------------
# The commands the pages show: `trtpipe COMMAND [SUBCOMMAND] --flag ...` in code blocks and inline code.

FENCE = re.compile(r"\s*(```|~~~)")
INLINE = re.compile(r"`([^`]+)`")
#: The group's own options, which come before the command.
GLOBAL_FLAGS = {"-v", "--verbose", "--version", "-h", "--help"}
FLAG = re.compile(r"--?[A-Za-z][\w-]*")


def code_and_prose(text: str) -> tuple[list[tuple[int, str]], list[tuple[int, str]]]:
    """The fenced blocks as (first line, text) and the inline code spans outside them as (line, text)."""
    blocks, prose, block, start = [], [], [], None
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            if start is None:
                start, block = number + 1, []
            else:
                blocks.append((start, "\n".join(block)))
                start = None
            prose.append("")
        elif start is not None:
            block.append(line)
            prose.append("")
        else:
            prose.append(line)
    spans = []
    for paragraph_start, paragraph in paragraphs(prose):
        for m in INLINE.finditer(paragraph):
            spans.append((paragraph_start + paragraph.count("\n", 0, m.start()), " ".join(m.group(1).split())))
    return blocks, spans


def paragraphs(lines: list[str]) -> list[tuple[int, str]]:
    """Runs of non-blank lines (an inline code span may wrap within one, never across a blank line)."""
    found, current, start = [], [], 0
    for number, line in enumerate([*lines, ""], 1):
        if line.strip():
            start = start or number
            current.append(line)
        elif current:
            found.append((start, "\n".join(current)))
            current, start = [], 0
    return found


def shell_commands(text: str) -> list[tuple[int, str]]:
    """The simple commands of a snippet, each with the line it starts on (0 for the first): continuation lines
    joined, comments dropped, split at newlines, `&&`, `||`, `;` and `|` outside quotes and brackets (so
    `(--tokens N | --minutes M)` stays one command)."""
    text = text.replace("\\|", "|")
    commands, current, depth, quote, line, start = [], [], 0, "", 0, 0
    i = 0
    while i < len(text):
        ch = text[i]
        if text.startswith("\\\n", i):
            current.append(" ")
            line += 1
            i += 2
            continue
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or text[i - 1].isspace()):
            i = text.find("\n", i)
            i = len(text) if i < 0 else i
            continue
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth = max(0, depth - 1)
        elif depth == 0 and (ch in ";|\n" or text.startswith("&&", i)):
            commands.append((start, "".join(current)))
            line += ch == "\n"
            current, quote, start = [], "", line
            i += 2 if text.startswith(("&&", "||"), i) else 1
            continue
        current.append(ch)
        i += 1
    commands.append((start, "".join(current)))
    return [(n, c.strip()) for n, c in commands if c.strip()]


def words(command: str) -> list[str]:
    try:
        return shlex.split(command)
    except ValueError:   # an unbalanced quote in a usage line: plain words are enough to find the flags
        return command.split()


def trtpipe_invocation(command: str) -> tuple[list[str], list[str], bool] | None:
    """(the command path, the flags, whether it is a whole example) of a `trtpipe ...` command line, or None for
    anything else (another program, a placeholder such as `trtpipe COMMAND -h`). A whole example gives the
    command's argument first and elides nothing (no `...`); a mention such as `trtpipe k8s --canary-of A` is not."""
    tokens = words(command)
    while tokens and (tokens[0] in ("$", "sudo") or re.fullmatch(r"[A-Za-z_]\w*=\S*", tokens[0])):
        tokens.pop(0)
    if not tokens or not (tokens[0] == "trtpipe" or tokens[0].endswith("/trtpipe")):
        return None
    rest = tokens[1:]
    while rest and rest[0] in GLOBAL_FLAGS:
        rest.pop(0)
    if not rest or not re.fullmatch(r"[a-z][a-z0-9-]*", rest[0]):
        return None
    path = [rest.pop(0)]
    if rest and re.fullmatch(r"[a-z][a-z0-9-]*", rest[0]) and isinstance(click_command(path[0]), click.Group):
        path.append(rest.pop(0))
    flags = []
    for token in rest:
        m = FLAG.match(token.lstrip("[(").split("=", 1)[0])
        if m:
            flags.append(m.group(0))
    whole = bool(rest) and not rest[0].startswith(("-", "[", "(")) and not any("..." in t or "…" in t for t in rest)
    return path, flags, whole


@cache
def command_tree() -> dict[tuple[str, ...], click.Command]:
    found = {}

    def walk(group: click.Group, prefix: tuple[str, ...]) -> None:
        ctx = click.Context(group)
        for name in group.list_commands(ctx):
            command = group.get_command(ctx, name)
            found[(*prefix, name)] = command
            if isinstance(command, click.Group):
                walk(command, (*prefix, name))

    walk(main, ())
    return found


def click_command(*path: str) -> click.Command | None:
    return command_tree().get(tuple(path))


def flags_of(command: click.Command) -> set[str]:
    """Every spelling of every option of COMMAND, its aliases and negations included, and the help option."""
    names = {o for p in command.params if isinstance(p, click.Option) for o in (*p.opts, *p.secondary_opts)}
    return names | set(main.context_settings.get("help_option_names", ["--help"]))


def invocations_in(page: Path) -> list[tuple[str, list[str], list[str], bool]]:
    """(where, command path, flags, whole example) of every `trtpipe ...` PAGE shows; every command of a code
    block counts as a whole example unless it elides something."""
    found = []
    blocks, spans = code_and_prose(page.read_text())
    for in_block, items in ((True, blocks), (False, spans)):
        for line, snippet in items:
            for offset, command in shell_commands(snippet):
                invocation = trtpipe_invocation(command)
                if invocation:
                    path, flags, whole = invocation
                    whole = whole or (in_block and "..." not in command and "…" not in command)
                    name = page.relative_to(REPO) if page.is_relative_to(REPO) else page.name
                    found.append((f"{name}:{line + offset}", path, flags, whole))
    return found


def doc_invocations() -> list[tuple[str, list[str], list[str], bool]]:
    return [found for page in pages() for found in invocations_in(page)]


def wrong_invocations(invocations) -> list[str]:
    """What a reader who copies them would hit: no such command, a flag the command lacks, or (in a whole
    example) a required option left out."""
    wrong = []
    for where, path, flags, whole in invocations:
        command = click_command(*path)
        if command is None:
            wrong.append(f"{where}: `trtpipe {' '.join(path)}` is no command")
            continue
        if isinstance(command, click.Group) and len(path) == 1:
            continue   # `trtpipe versions`, `trtpipe ci`: the group itself
        unknown = sorted(set(flags) - flags_of(command))
        if unknown:
            wrong.append(f"{where}: `trtpipe {' '.join(path)}` has no {', '.join(unknown)}")
        required = [o.opts[-1] for o in command.params if isinstance(o, click.Option) and o.required
                    and not set(o.opts) & set(flags)]
        if whole and required and "-h" not in flags and "--help" not in flags:
            wrong.append(f"{where}: `trtpipe {' '.join(path)}` needs {', '.join(required)}")
    return wrong


def test_every_command_the_docs_show_exists_with_the_flags_they_give_it():
    invocations = doc_invocations()
    assert len(invocations) >= 100, "the command finder no longer sees the docs' commands"
    shown = {tuple(path) for _, path, _, _ in invocations}
    assert {("build",), ("serve",), ("plan",), ("package",), ("ci", "github"), ("versions", "list")} <= shown
    wrong = wrong_invocations(invocations)
    assert not wrong, "\n".join(wrong)


def test_the_command_finder_reads_code_blocks_inline_code_and_usage_lines(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("\n".join([
        "Run `trtpipe plan smollm2-135m --target cpu --priority-levels 2` first, or `trtpipe COMMAND -h`.",
        "A span may wrap: `trtpipe compare out/a",
        "out/b --load-test` and `.venv/bin/trtpipe -v serve REPO`; `trtpipe package BUILD --key K`,",
        "`trtpipe k8s --canary-of A` and `trtpipe calibrate CKPT ... --precision fp8`.",
        "",
        "```bash",
        "bash scripts/setup.sh && .venv/bin/trtpipe build m --target cpu \\",
        "    -o out/x   # a comment --not-a-flag",
        "trtpipe distill S -o O --teacher T (--tokens N | --minutes M) | tee log",
        "docker run -it trtpipe bash",
        "trtpipe versions list REPO --json; trtpipe matrix trtpipe.toml --nope",
        "```",
    ]))
    found = [(where.split(":")[1], *rest) for where, *rest in invocations_in(page)]
    assert found == [
        ("7", ["build"], ["--target", "-o"], True),
        ("9", ["distill"], ["-o", "--teacher", "--tokens", "--minutes"], True),
        ("11", ["versions", "list"], ["--json"], True),
        ("11", ["matrix"], ["--nope"], True),
        ("1", ["plan"], ["--target", "--priority-levels"], True),
        ("2", ["compare"], ["--load-test"], True),
        ("3", ["serve"], [], True),
        ("3", ["package"], ["--key"], True),
        ("4", ["k8s"], ["--canary-of"], False),
        ("4", ["calibrate"], ["--precision"], False),
    ]
    assert wrong_invocations([("p", ["matrix"], ["--nope"], True), ("p", ["plan"], ["--max-model-len", "-h"], True),
                              ("p", ["bogus"], [], True), ("p", ["versions"], [], True),
                              ("p", ["package"], ["--key"], True), ("p", ["package"], ["--key"], False),
                              ("p", ["package"], ["-h"], True)]) == [
        "p: `trtpipe matrix` has no --nope", "p: `trtpipe bogus` is no command", "p: `trtpipe package` needs --output"]


# ---------------------------------------------------------------------------------------------------------------
# The repository paths the pages name.

#: A path inside this repository, as the docs name one: not part of a longer path, a URL or another repository's
#: file (`BE:docs/...`, `TRTLLM:tests/...`, `/tmp/x/model_repo`, `~/.cache/...`).
REPO_PATH = re.compile(r"(?<![\w./~$:@<>{-])((?:pipeline|docs|benchmarks|tests|scripts|model_repo|calibration|"
                       r"\.github|\.ci)/[\w./*-]*)")


def named_paths(text: str) -> list[str]:
    found = []
    for m in REPO_PATH.finditer(text):
        path = m.group(1).rstrip(".,:;-")
        if "..." not in path and "…" not in text[m.end():m.end() + 1]:
            found.append(path)
    return found


def path_exists(path: str) -> bool:
    return any(REPO.glob(path)) if "*" in path else (REPO / path).exists()


def test_every_repository_path_the_docs_name_exists():
    missing, seen = [], 0
    for page in pages():
        for number, line in enumerate(page.read_text().splitlines(), 1):
            for path in named_paths(line):
                seen += 1
                if not path_exists(path):
                    missing.append(f"{page.relative_to(REPO)}:{number}: {path}")
    assert seen >= 100, "the path finder no longer sees the docs' paths"
    assert not missing, "\n".join(missing)


def test_the_path_finder_sees_this_repositorys_paths_only():
    text = ("`pipeline/runtime/generate.py serve_rows`, tests/test_inflight.py::test_x, docs/onnx.md). "
            "benchmarks/bench_*.py, `BE:docs/model_config.md`, /tmp/bcs/model_repo/x, ~/.cache/trtpipe, "
            "https://github.com/o/r/tree/main/tests/a.py, pipeline/.../x.py, scripts/setup.sh.")
    assert named_paths(text) == ["pipeline/runtime/generate.py", "tests/test_inflight.py", "docs/onnx.md",
                                 "benchmarks/bench_*.py", "scripts/setup.sh"]
    assert path_exists("benchmarks/bench_*.py") and not path_exists("docs/nowhere.md")


# ---------------------------------------------------------------------------------------------------------------
# Issue and run numbers: a reader of a clone cannot follow "issue 27" or "run 13".

ISSUE_OR_RUN = re.compile(r"\b[Ii]ssues? #?[0-9]+|\b[Rr]uns? [0-9]+\b")
#: Upstream issues a reader can look up: `OWNER/REPO#N` (never matched), or the repository named right before,
#: as in "server issues #7116/#6055".
UPSTREAM_REPO = re.compile(r"\b(?:server|tensorrtllm_backend|python_backend|TensorRT-LLM|TensorRT|vLLM|vllm|"
                           r"aiperf|transformers|modelopt|[\w.-]+/[\w.-]+) $")


def unfollowable_numbers(text: str) -> list[str]:
    return [m.group(0) for m in ISSUE_OR_RUN.finditer(text)
            if not (m.group(0).lower().startswith("issue") and UPSTREAM_REPO.search(text[:m.start()]))]


def test_no_doc_cites_an_issue_or_run_number_a_reader_cannot_follow():
    cited = [f"{page.relative_to(REPO)}:{number}: {hit}" for page in pages()
             for number, line in enumerate(page.read_text().splitlines(), 1) for hit in unfollowable_numbers(line)]
    assert not cited, "\n".join(cited)


def test_the_number_finder_keeps_upstream_references():
    assert unfollowable_numbers("the scheduler of issue 27; Run 13 below; runs 5-8; Issues #3") == [
        "issue 27", "Run 13", "runs 5", "Issues #3"]
    assert unfollowable_numbers("server issues #7116/#6055, NVIDIA/TensorRT-LLM#1913, tensorrtllm_backend#210, "
                                "20 runs, the run A and run B of a fit") == []


# ---------------------------------------------------------------------------------------------------------------
# The size of the test suite changes with every commit: the docs give none, rather than four that disagree.

TEST_COUNT = re.compile(r"\b\d{3,}(?: of \d{3,})? tests\b|\b\d{3,} passed\b|\bsuite has \d+")


@pytest.mark.parametrize("text, counted", [("830 tests in about 3m20s", True), ("925 passed, 1 skipped", True),
                                           ("ran 880 of 923 tests", True), ("the suite has 926 now", True),
                                           ("the tests in tests/test_docs.py", False)])
def test_the_count_finder(text, counted):
    assert bool(TEST_COUNT.search(text)) is counted


def test_no_doc_states_how_many_tests_there_are():
    stated = [f"{page.relative_to(REPO)}: {m.group(0)}" for page in pages()
              for m in TEST_COUNT.finditer(page.read_text())]
    assert not stated, stated
