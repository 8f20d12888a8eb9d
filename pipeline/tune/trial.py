"""One trial: render the candidate's repository, serve it, run the fixed load, stop early when the SLO breaks.

- render: `deploy_repository` for the candidate's plan (the overlay, `space.candidate_plan`), then the
  instance counts, which the plan does not hold, set on the ModelConfig messages deploy wrote (parsed with
  the real schema, never edited as text) and recorded in the repository's manifest;
- serve: the embedded Triton server on the candidate repository, or, with `--url`, the running server's
  models reloaded with the candidate's configs through Triton's model-control API
  (`POST /v2/repository/models/NAME/load` with the config as JSON: needs `--model-control-mode=explicit`);
- load: the concurrency levels in ascending order, each `run_level` (validate's load generator) or
  `run_aiperf` (`--load-generator aiperf`, pipeline/validate/aiperf.py); after each level `should_stop` may end
  the trial (the study stops at the first level that breaks the SLO: more clients only wait longer).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import shutil
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterator


from ..backends import backend_for
from ..deploy import deploy_repository
from ..errors import UserError
from ..model_repository import CONFIG, ModelRepository, read_repository
from ..outputs import MANIFEST, describe_outputs
from ..plan import Plan
from ..server import connect, embedded_server, wait_until_ready
from ..triton_names import ENSEMBLE, POSTPROCESSING, PREPROCESSING, TENSORRT_LLM, TENSORRT_LLM_BLS
from ..tritonconfig import to_pbtxt
from ..validate import EnsembleClient, run_level
from ..validate.energy import LoadMeter, meter_for
from ..validate.load_test import with_predictions
from ..validate.checks import check_config_matches
from .source import TuneSource
from .space import Candidate, Instances
from ..triton_admin import LoadRefused, NotServed, TritonAdmin
from ..compile import compile_engine, missing_build_requirements

LOAD_GENERATORS = ("builtin", "aiperf")
REQUEST_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class LoadSpec:
    """The fixed load every trial gets: prompts, tokens per request, concurrency sweep (ascending)."""

    prompts: tuple[str, ...]
    prompts_from: str
    max_tokens: int
    concurrencies: tuple[int, ...]
    requests_per_client: int
    generator: str = "builtin"
    #: the deployment's price per hour: each level's cost per million output tokens
    price_per_hour: float | None = None
    #: the SLO bounds energy per token: a trial without a readable energy counter is refused, not judged
    needs_energy: bool = False

    def identity(self) -> dict:
        """What makes two studies' measurements comparable (the prompts themselves, not where they came from)."""
        prompts = hashlib.sha256(json.dumps(self.prompts).encode()).hexdigest()[:16]
        return {"prompts": len(self.prompts), "prompts_sha256": prompts, "max_tokens": self.max_tokens,
                "concurrencies": list(self.concurrencies), "requests_per_client": self.requests_per_client,
                "generator": self.generator}


def parse_concurrencies(text: str) -> tuple[int, ...]:
    try:
        levels = tuple(sorted({int(c) for c in text.split(",")}))
    except ValueError:
        raise UserError(f"--concurrency must be comma-separated whole numbers, got {text!r}") from None
    if not levels or levels[0] < 1:
        raise UserError(f"--concurrency levels must be at least 1, got {text!r}")
    return levels


def check_load_generator(name: str) -> None:
    if name not in LOAD_GENERATORS:
        raise UserError(f"--load-generator must be one of {', '.join(LOAD_GENERATORS)}, not {name!r}")
    if name != "aiperf":
        return
    if importlib.util.find_spec("pipeline.validate.aiperf") is None:
        raise UserError("--load-generator aiperf needs pipeline/validate/aiperf.py (run_aiperf), which this trtpipe "
                        "does not have; use --load-generator builtin")
    from ..validate.aiperf import aiperf_executable

    aiperf_executable()   # a UserError saying how to install it


# ----------------------------------------------------------------------------------------------
# Rendering


def render_candidate(source: TuneSource, plan: Plan, candidate: Candidate, out: Path,
                     engine: Path | None) -> Path:
    """The candidate's model repository at `out` (replaced if it exists)."""
    deploy_repository(plan, out, engine=engine, checkpoint=source.checkpoint, tokenizer=source.tokenizer, force=True)
    set_instance_counts(out, candidate.instances)
    return out


def set_instance_counts(repo: Path, instances: Instances) -> None:
    """Each model's instance_group count, on its ModelConfig; the manifest records them and its output hashes."""
    counts = asdict(instances)
    if all(count == 1 for count in counts.values()):
        return   # what deploy wrote
    repository = read_repository(repo)
    for model, count in counts.items():
        config = repository.config(model)
        if not config.instance_group:
            config.instance_group.add(count=count)
        for group in config.instance_group:
            group.count = count
        (repo / model / CONFIG).write_text(to_pbtxt(config))
    manifest = dict(repository.manifest.raw) if repository.manifest else {}
    manifest["params"] = {**manifest.get("params", {}), "instances": counts}   # deploy's own check sees the change
    manifest["outputs"] = describe_outputs(repo)
    (repo / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")


# ----------------------------------------------------------------------------------------------
# Serving


@contextmanager
def serving(repo: Path, url: str | None, log_path: Path, ready_timeout: float) -> Iterator[EnsembleClient]:
    """A client of the candidate repository served: by the embedded server, or by the server at `url` with its
    models reloaded from the candidate's configs (and checked to be what it then serves)."""
    if url is None:
        with embedded_server(repo, log_path=log_path, ready_timeout=ready_timeout) as server:
            yield EnsembleClient(server, timeout=REQUEST_TIMEOUT_S)
        return
    with connect(url, ready_timeout=ready_timeout) as server:
        reload_models(server.http_url, repo)
        wait_until_ready(server, ready_timeout)
        served = check_config_matches(server, repo)
        if not served.passed:
            raise RuntimeError(f"{server.http_url} does not serve the trial's configs after reloading: {served.detail}")
        yield EnsembleClient(server, timeout=REQUEST_TIMEOUT_S)


def reload_order(http_url: str, repository: ModelRepository) -> tuple[str, ...]:
    """Triton refuses an ensemble whose max_batch_size exceeds a composing model's: when the batch shrinks the
    ensemble (and BLS) go first, when it grows the composing models do."""
    try:
        current = TritonAdmin(http_url).config(ENSEMBLE).get("max_batch_size", 0)
    except NotServed:
        current = 0
    wanted = repository.config(ENSEMBLE).max_batch_size
    callers, composing = (ENSEMBLE, TENSORRT_LLM_BLS), (PREPROCESSING, TENSORRT_LLM, POSTPROCESSING)
    return callers + composing if wanted < current else composing + callers


def reload_models(http_url: str, repo: Path) -> None:
    """Load every model of `repo` on the server with the repository's config (model control, explicit mode)."""
    admin, repository = TritonAdmin(http_url), read_repository(repo)
    for name in reload_order(http_url, repository):
        try:
            admin.load(name, repository.config(name))
        except LoadRefused as refused:
            if refused.model_control:
                raise UserError(f"the server at {http_url} does not let trtpipe reload models ({refused.status}: "
                                f"{refused.text}); start it with `trtpipe serve REPO --model-control-mode explicit` "
                                "(tritonserver: --model-control-mode=explicit --load-model=*) so each trial's "
                                "configuration can be loaded") from None
            raise RuntimeError(f"{http_url} refused the trial's config of {name} ({refused.status}: "
                               f"{refused.text})") from None


# ----------------------------------------------------------------------------------------------
# The load


def run_load_level(client: EnsembleClient, load: LoadSpec, concurrency: int, tokenizer: Path, workdir: Path,
                   meter: LoadMeter) -> dict:
    """One concurrency level with the chosen generator: a record with run_level's keys and its energy (aiperf counts
    tokens with `tokenizer` and keeps its files in `workdir`; the meter reads the same counters around it)."""
    if load.generator == "aiperf":
        from ..validate.aiperf import run_aiperf

        with meter.window() as reading:
            level = run_aiperf(client.server.http_url, tokenizer, load.prompts, load.max_tokens, concurrency,
                               concurrency * load.requests_per_client, workdir / f"aiperf-c{concurrency}")
        return {**level, "energy": meter.kpis(reading, level["output_tokens"])}
    return run_level(client, load.prompts, load.max_tokens, concurrency, load.requests_per_client, meter)


def load_meter(client: EnsembleClient, load: LoadSpec) -> LoadMeter:
    """The trial server's meter; UserError when the SLO bounds energy and no counter is readable."""
    meter = meter_for(client.server, load.price_per_hour)
    if load.needs_energy and meter.counter is None:
        raise UserError(f"the SLO bounds joules_per_token but no energy counter is readable: {meter.energy_reason}")
    return meter


def measure(client: EnsembleClient, load: LoadSpec, should_stop: Callable[[dict], bool], tokenizer: Path,
            workdir: Path, plan: Plan | None = None) -> list[dict]:
    """The sweep, ascending, until a level makes `should_stop` true (that level is kept); each level with what
    the candidate's `plan` predicted for it."""
    meter = load_meter(client, load)
    client.generate(load.prompts[0], 2)   # warm-up: the first request's costs are not the configuration's
    levels = []
    for concurrency in load.concurrencies:
        levels.append(run_load_level(client, load, concurrency, tokenizer, workdir, meter))
        if should_stop(levels[-1]):
            break
    return with_predictions(levels, plan, tokenizer, load.prompts)


@dataclass(frozen=True)
class TrialRunner:
    """Renders, serves and loads candidates of `source` under `work` (one directory per trial)."""

    source: TuneSource
    load: LoadSpec
    work: Path
    url: str | None = None
    ready_timeout: float = 600.0

    def run(self, number: int, candidate: Candidate, plan: Plan, should_stop: Callable[[dict], bool]) -> list[dict]:
        trial_dir = self.work / f"trial-{number}"
        shutil.rmtree(trial_dir, ignore_errors=True)
        trial_dir.mkdir(parents=True)
        engine = self.engine_for(plan, trial_dir)
        repo = render_candidate(self.source, plan, candidate, trial_dir / "model_repo", engine)
        try:
            with serving(repo, self.url, trial_dir / "tritonserver.log", self.ready_timeout) as client:
                return measure(client, self.load, should_stop, self.source.tokenizer, trial_dir, plan)
        finally:
            shutil.rmtree(repo, ignore_errors=True)   # the log stays; the winner is rendered again

    def engine_for(self, plan: Plan, trial_dir: Path) -> Path | None:
        """The engine the candidate serves: the deployment's, or with --rebuild one compiled for it."""
        if plan.build_config is None:
            return None
        if plan.build_config == self.source.plan.build_config:
            return self.source.engine
        engine = trial_dir / "engine"
        compile_engine(self.source.checkpoint, plan, engine, force=True)
        return engine


def check_can_serve(source: TuneSource, url: str | None, rebuild: bool) -> None:
    """Refuse, before any trial, what this machine cannot measure."""
    backend = backend_for(source.plan.backend)
    if url is None and not backend.serves_embedded:
        raise UserError(
            f"serving trials of this {source.plan.backend} deployment ({source.plan.target.name}) needs the GPU "
            "server: Triton with the tensorrtllm backend, started on the repository with --model-control-mode=explicit "
            "--load-model=*, on the GPU box; pass its --url (e.g. http://gpu-box:8000). Nothing was measured: this "
            "machine cannot run TensorRT-LLM engines")
    if rebuild and source.checkpoint is None:
        raise UserError("--rebuild compiles each candidate from the checkpoint: pass the build directory "
                        "(it holds checkpoint/), not the model repository")
    if rebuild:
        missing = missing_build_requirements()
        if missing:
            raise UserError(f"--rebuild compiles each candidate with trtllm-build, and {missing}: run trtpipe tune "
                            "--rebuild on the GPU box (the trtpipe image), or tune without --rebuild")
