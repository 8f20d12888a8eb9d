"""The served side of a comparison: the prompts, and what one server answers (greedy completions and,
optionally, the load test at one concurrency), through validate's client and load generator."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..errors import UserError
from ..evaluate import corpus_split
from ..server import connect, embedded_server
from ..validate import DEFAULT_PROMPTS, EnsembleClient, run_level
from ..validate.energy import meter_for
from ..validate.client import RequestFailed
from ..validate.report import ValidateOptions
from ..validate.speculative import check_speculation
from ..plan.schema import SpeculativePlan

#: --prompts recipes: the held-out news corpus (never calibrated on), or validate's four prompts.
PROMPT_RECIPES = ("heldout", "validate")
PROMPT_WORDS = 12


@dataclass(frozen=True)
class ServeOptions:
    max_tokens: int = 16
    load_test: bool = False
    concurrency: int = 4
    requests_per_client: int = 4
    ready_timeout: float = 600.0
    price_per_hour: float | None = None


@dataclass(frozen=True)
class ServedFigures:
    server: str
    completions: list[str]
    load: dict | None          # validate's run_level record at the comparison's concurrency
    speculation: dict | None = None   # a speculating build: validate's speculation check's figures on the prompts


def load_prompts(spec: str | None, count: int) -> tuple[str, list[str]]:
    """(description, prompts): a recipe name, or a text file with one prompt per line."""
    if count < 1:
        raise UserError(f"--num-prompts must be at least 1 (got {count})")
    if spec is None or spec == "heldout":
        lines = corpus_split()[1][:count]
        return (f"the first {PROMPT_WORDS} words of {len(lines)} held-out news documents",
                [" ".join(line.split()[:PROMPT_WORDS]) for line in lines])
    if spec == "validate":
        return "validate's default prompts", list(DEFAULT_PROMPTS)
    path = Path(spec).expanduser()
    if not path.is_file():
        raise UserError(f"--prompts {spec} is neither a file nor a recipe ({', '.join(PROMPT_RECIPES)})")
    prompts = [line.strip() for line in path.read_text(encoding="utf-8", errors="replace").splitlines()
               if line.strip()]
    if not prompts:
        raise UserError(f"--prompts {path} has no prompt (every line is empty)")
    return str(path), prompts[:count]


def serve_and_measure(repo: Path, url: str | None, prompts: list[str], options: ServeOptions,
                      say=lambda message: None, speculative: SpeculativePlan | None = None) -> ServedFigures:
    """Serve `repo` with the embedded Triton (or use the server at `url`); greedy completions one request at a
    time (no batching partner changes the numerics), then, for a build that speculates (`speculative`, its plan's),
    its acceptance rate and drafts a step on the same prompts, then the load test when asked."""
    context = connect(url, ready_timeout=60.0) if url else embedded_server(repo, ready_timeout=options.ready_timeout)
    with context as server:
        say(f"serving {repo if url is None else url} at {server.http_url}")
        client = EnsembleClient(server)
        try:
            completions = [client.generate(prompt, options.max_tokens) for prompt in prompts]
        except RequestFailed as exc:
            raise RuntimeError(f"{server.http_url}: {exc}") from None
        speculation = None
        if speculative is not None:
            say("speculation: the acceptance rate and drafts a step on the prompts")
            check = check_speculation(client, ValidateOptions(prompts=tuple(prompts), max_tokens=options.max_tokens),
                                      speculative)
            if not check.passed:
                raise RuntimeError(f"{server.http_url}: speculation: {check.detail}")
            speculation = {"method": speculative.method, "draft_len": speculative.draft_len, **check.data}
        load = None
        if options.load_test:
            say(f"load test: {options.concurrency} clients x {options.requests_per_client} requests")
            load = run_level(client, tuple(prompts), options.max_tokens, options.concurrency,
                             options.requests_per_client, meter_for(server, options.price_per_hour))
        return ServedFigures(server.http_url, completions, load, speculation)
