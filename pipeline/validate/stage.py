"""The validate stage: serve a repository (or connect to a running server), run every check in order and
write report.json atomically; and the golden reference: from what the caller knows (`golden_reference`,
as `trtpipe build` calls it), or from the record deploy wrote into the repository's manifest
(`reference_for`, for `trtpipe validate REPO`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from ..backends import backend_for, bls_draft_len, not_streamed
from ..backends.names import INFLIGHT_BATCHER
from ..backends.pytorch import LLMAPI
from ..errors import UserError
from ..model_repository import read_deployment, read_repository
from ..outputs import atomic_output_dir, portable
from ..precisions import QUANT_ALGO
from ..server import TritonServer, connect, embedded_server
from ..triton_admin import TritonAdmin
from .checks import (
    check_bad_requests,
    check_config_matches,
    check_golden,
    check_http_generate,
    check_models_ready,
    check_streaming,
)
from .client import ENSEMBLE, EnsembleClient
from .llmapi import MODEL as LLMAPI_MODEL
from .llmapi import LlmapiClient, llmapi_bad_requests
from .energy import meter_for
from .load_test import check_load_test
from .metrics import METRICS_PORT, check_metrics, counts_before
from .speculative import NAME as SPECULATION
from .speculative import check_bls_drafting, check_speculation
from .report import CheckResult, GreedyReference, ValidateOptions, ValidationReport


def run_checks(server: TritonServer, repo: Path | None, options: ValidateOptions, out_dir: Path,
               progress: Callable[[str], None] = lambda name: None) -> list[CheckResult]:
    checks = [check_models_ready(server, repo)]
    if not checks[0].passed:
        return checks
    checks.append(check_config_matches(server, repo))
    plan, tokenizer = load_test_context(repo)
    spec = plan.speculative if plan is not None else None
    unstreamed = not_streamed(plan)
    if repository_layout(repo, server) == LLMAPI:
        client = LlmapiClient(server.http_url, timeout=options.request_timeout)
        steps = [("golden", check_golden), ("streaming", check_streaming),
                 ("bad_requests", lambda c, o: check_bad_requests(c, o, llmapi_bad_requests(o.prompts[0])))]
    else:
        client = EnsembleClient(server, options.request_timeout, perf_metrics=spec is not None)
        steps = [("golden", check_golden), ("streaming", check_streaming), ("http_generate", check_http_generate),
                 ("bad_requests", check_bad_requests)]
    if unstreamed:
        steps = [(name, skipping(name, unstreamed) if name == "streaming" else
                  (lambda c, o: check_http_generate(c, o, stream=False)) if name == "http_generate" else check)
                 for name, check in steps]
    before = counts_before(server.endpoints.metrics_url, client.model) if options.metrics else None
    for name, check in steps:
        progress(name)
        checks.append(check(client, options))
    if spec is not None and isinstance(client, EnsembleClient):
        progress(SPECULATION)
        bls = bls_draft_len(plan) is not None
        checks.append((check_bls_drafting if bls else check_speculation)(client, options, spec))
    if options.load_test:
        progress("load_test")
        checks.append(skipping("load_test", unstreamed)(client, options) if unstreamed else check_load_test(
            client, options, out_dir, plan, tokenizer, meter_for(server, options.price_per_hour)))
    if options.metrics:
        progress("metrics")
        checks.append(check_metrics(client, server.endpoints.metrics_url, before))
    return checks


def skipping(name: str, why: str) -> Callable:
    """A check that is not run, for `why`."""
    return lambda client, options: CheckResult(name, False, why, skipped=True,
                                               fix=f"{name} streams its requests: validate a streaming (decoupled) "
                                               "deployment of the model for it")


def load_test_context(repo: Path | None):
    """The plan deploy recorded in REPO and its tokenizer (None, None for a repository deploy did not write)."""
    if repo is None:
        return None, None
    try:
        repository = read_repository(repo)
        return repository.plan(), repository.tokenizer
    except UserError:
        return None, None


def repository_layout(repo: Path | None, server: TritonServer) -> str:
    """INFLIGHT_BATCHER or LLMAPI: the layout of the backend deploy recorded for REPO, else (a repository deploy
    did not write, or none given) LLMAPI when the server has no `ensemble` model but a `tensorrt_llm` one."""
    served = read_deployment(repo) if repo else None
    if served is not None:
        return backend_for(served.backend).layout
    admin = TritonAdmin(server.http_url)
    has = {name: admin.serves(name) for name in (ENSEMBLE, LLMAPI_MODEL)}
    return LLMAPI if has[LLMAPI_MODEL] and not has[ENSEMBLE] else INFLIGHT_BATCHER


def validate_repository(repo: Path | None, out: Path, options: ValidateOptions | None = None, *,
                        url: str | None = None, grpc_url: str | None = None, metrics_url: str | None = None,
                        ready_timeout: float = 600.0,
                        progress: Callable[[str], None] = lambda name: None) -> ValidationReport:
    """Serve `repo` (or use the server at `url`: gRPC and metrics default to Triton's ports beside it), run
    every check and write report.json into `out`."""
    options = options or ValidateOptions()
    repo = Path(repo).resolve() if repo is not None else None
    if repo is not None and not repo.is_dir():
        raise UserError(f"model repository {repo} does not exist or is not a directory")
    if url is None and repo is None:
        raise UserError("give a model repository to serve, or --url of a running server")
    with atomic_output_dir(Path(out)) as tmp:
        progress("starting the server" if url is None else f"connecting to {url}")
        server_context = (connect(url, grpc_url=grpc_url or default_grpc_url(url),
                                  metrics_url=metrics_url or default_metrics_url(url), ready_timeout=ready_timeout)
                          if url else embedded_server(repo, log_path=tmp / "server.log", ready_timeout=ready_timeout))
        with server_context as server:
            checks = run_checks(server, repo, options, tmp, progress)
        report = ValidationReport(repo=str(repo) if repo else "", server=url or server.http_url, checks=checks,
                                  log_path=str(Path(out).resolve() / "server.log") if url is None else None)
        (tmp / "report.json").write_text(report_json(report, Path(out).resolve().parent))
    return report


def report_json(report: ValidationReport, build_dir: Path) -> str:
    """report.json's text: the repository and log it names relative to BUILD_DIR (the directory holding the
    report's; `model_repo` and `validation/server.log` in a build), under home `~/...`: no machine's paths."""
    return json.dumps(portable(report.to_dict(), build_dir), indent=2) + "\n"


def default_grpc_url(http_url: str) -> str:
    """Triton's convention: gRPC on the HTTP port + 1 of the same host."""
    host_port = http_url.split("://", 1)[-1].rstrip("/")
    host, _, port = host_port.rpartition(":")
    return f"{host}:{int(port) + 1}" if port.isdigit() else f"{host_port}:8001"


def default_metrics_url(http_url: str) -> str:
    """Triton's convention: metrics on port 8002 of the HTTP URL's host."""
    host_port = http_url.split("://", 1)[-1].rstrip("/")
    host = host_port.rpartition(":")[0] if host_port.rpartition(":")[2].isdigit() else host_port
    return f"http://{host}:{METRICS_PORT}"


def golden_reference(model: str | None, *, precision: str, weights_dtype: str,
                     device: str = "auto") -> GreedyReference | None:
    """The golden reference for a repository serving MODEL at PRECISION from a WEIGHTS_DTYPE checkpoint: the
    Hugging Face model run with its weights rounded to that dtype, compared exactly unless quantized."""
    from ..golden import GoldenReference

    if model is None:
        return None
    return GoldenReference.from_spec(model, exact=precision not in QUANT_ALGO, weights_dtype=weights_dtype,
                                       device=device)


def reference_for(repo: Path | None, golden: str | None, device: str = "auto") -> GreedyReference | None:
    """`trtpipe validate REPO`'s golden reference: --golden MODEL, else the model deploy recorded in REPO's
    manifest (`pipeline.model_repository.read_deployment`), with the precision and dtype recorded there (an exact
    float32 comparison for a repository deploy did not write); None when there is no model to compare with."""
    served = read_deployment(Path(repo)) if repo else None
    return golden_reference(golden or (served.model if served else None),
                            precision=served.precision if served else "fp32",
                            weights_dtype=served.weights_dtype if served else "float32", device=device)
