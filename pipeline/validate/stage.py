"""The validate stage: serve a repository (or connect to a running server), run every check in order and
write report.json atomically; and the golden reference a repository's own deploy records call for.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from ..errors import UserError
from ..outputs import atomic_output_dir
from ..server import TritonServer, connect, embedded_server
from .checks import (
    GoldenReference,
    check_bad_requests,
    check_config_matches,
    check_golden,
    check_http_generate,
    check_models_ready,
    check_streaming,
)
from .client import EnsembleClient
from .load_test import check_load_test
from .report import CheckResult, ValidateOptions, ValidationReport


def run_checks(server: TritonServer, repo: Path | None, options: ValidateOptions, out_dir: Path,
               progress: Callable[[str], None] = lambda name: None) -> list[CheckResult]:
    checks = [check_models_ready(server, repo)]
    if not checks[0].passed:
        return checks
    checks.append(check_config_matches(server, repo))
    client = EnsembleClient(server, options.request_timeout)
    steps = [("golden", check_golden), ("streaming", check_streaming), ("http_generate", check_http_generate),
             ("bad_requests", check_bad_requests)]
    for name, check in steps:
        progress(name)
        checks.append(check(client, options))
    if options.load_test:
        progress("load_test")
        checks.append(check_load_test(client, options, out_dir))
    return checks


def validate_repository(repo: Path | None, out: Path, options: ValidateOptions | None = None, *,
                        url: str | None = None, grpc_url: str | None = None, ready_timeout: float = 600.0,
                        progress: Callable[[str], None] = lambda name: None) -> ValidationReport:
    """Serve `repo` (or use the server at `url`), run every check and write report.json into `out`."""
    options = options or ValidateOptions()
    repo = Path(repo).resolve() if repo is not None else None
    if repo is not None and not repo.is_dir():
        raise UserError(f"model repository {repo} does not exist or is not a directory")
    if url is None and repo is None:
        raise UserError("give a model repository to serve, or --url of a running server")
    with atomic_output_dir(Path(out)) as tmp:
        progress("starting the server" if url is None else f"connecting to {url}")
        server_context = (connect(url, grpc_url=grpc_url or default_grpc_url(url), ready_timeout=ready_timeout)
                          if url else embedded_server(repo, log_path=tmp / "server.log", ready_timeout=ready_timeout))
        with server_context as server:
            checks = run_checks(server, repo, options, tmp, progress)
        report = ValidationReport(repo=str(repo) if repo else "", server=url or server.http_url, checks=checks,
                                  log_path=str(Path(out).resolve() / "server.log") if url is None else None)
        (tmp / "report.json").write_text(json.dumps(report.to_dict(), indent=2) + "\n")
    return report


def default_grpc_url(http_url: str) -> str:
    """Triton's convention: gRPC on the HTTP port + 1 of the same host."""
    host_port = http_url.split("://", 1)[-1].rstrip("/")
    host, _, port = host_port.rpartition(":")
    return f"{host}:{int(port) + 1}" if port.isdigit() else f"{host_port}:8001"


def golden_spec_from_repo(repo: Path) -> tuple[str | None, bool]:
    """(model spec, exact) recorded by deploy: the plan's model when it is not a bare checkpoint."""
    try:
        manifest = json.loads((repo / "manifest.json").read_text())
        plan = json.loads(Path(manifest["plan"]).read_text())
    except (OSError, KeyError, ValueError, TypeError):
        return None, True
    model = plan.get("model", {})
    exact = plan.get("precision") not in ("fp8", "int8-sq")
    if model.get("source") in (None, "checkpoint", "arch"):
        return None, exact
    return model.get("path") or model.get("name"), exact


def reference_for(repo: Path | None, golden: str | None, device: str = "auto") -> GoldenReference | None:
    """The golden reference: --golden MODEL, else the model recorded in the repository's plan, else None."""
    from ..golden import GoldenReference as StreamedReference

    spec, exact = golden_spec_from_repo(Path(repo)) if repo else (None, True)
    spec = golden or spec
    dtype = served_checkpoint_dtype(Path(repo)) if repo else "float32"
    return StreamedReference.from_spec(spec, exact=exact, weights_dtype=dtype, device=device) if spec else None


def served_checkpoint_dtype(repo: Path) -> str:
    """The weight dtype of the checkpoint a cpu-target repository serves (float32 when unknown)."""
    try:
        dtype = json.loads((repo / "tensorrt_llm" / "1" / "checkpoint" / "config.json").read_text())["dtype"]
    except (OSError, KeyError, ValueError, TypeError):
        return "float32"
    return dtype if dtype in ("float16", "bfloat16", "float32") else "float32"

