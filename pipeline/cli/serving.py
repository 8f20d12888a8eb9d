"""The commands that judge a model repository: check, validate, serve, compare, tune, doctor."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from ..errors import UserError
from ..server import MODEL_CONTROL_MODES
from .base import (MODEL_HELP, choice, concurrency_option, device_option, json_option, main, max_tokens_option,
                   price_option, report_verification, repository_argument)


@main.command()
@repository_argument()
@click.option("--engine", type=click.Path(path_type=Path), default=None,
              help="Engine directory to check against (default: the tensorrt_llm model's gpt_model_path).")
@click.option("--json", "as_json", is_flag=True, help="Print the findings as JSON.")
def check(repo, engine, as_json):
    """Static checks of a Triton LLM model repository (trtpipe's or one made with fill_template.py).

    \b
    Schema of every config.pbtxt, unfilled ${...} placeholders, ensemble wiring, batch sizes against
    the engine's config.json, streaming without decoupled mode, KV-cache reuse / chunked context
    without paged context FMHA, preferred batch sizes, the engine's TensorRT-LLM version.
    Exit status 1 when anything is wrong.
    Examples:
      trtpipe check out/model_repo
      trtpipe check triton_model_repo --engine /engines/llama3 --json
    """
    from ..check import check_repository

    report_verification(check_repository(repo, engine=engine), as_json)


@main.command()
@repository_argument(required=False)
@click.option("--url", default=None, help="HTTP URL of a running Triton server serving REPO (default: start the "
              "embedded server on REPO), or with --api openai of an OpenAI-compatible server.")
@click.option("--api", type=choice(["triton", "openai"]), default="triton", show_default=True,
              help="What is validated: Triton's API (the repository's contract: engine ensemble or llmapi, told from "
              "deploy's record) or the OpenAI-compatible API (/v1/completions, /v1/chat/completions, /v1/models, "
              "/health): of the server at --url (trtllm-serve, vLLM, `trtpipe serve --openai`; REPO optional, for "
              "the golden reference), or without --url of trtpipe's OpenAI front over REPO in the embedded server.")
@click.option("--model", "served_model", default=None, metavar="NAME",
              help="With --api openai: the model name to request (default: the first /v1/models lists).")
@click.option("--grpc-url", default=None,
              help="host:port of that server's gRPC endpoint (default: the --url port + 1).")
@click.option("--metrics-url", default=None, help="That server's Prometheus metrics endpoint, http://HOST:PORT "
              "(default: the --url host, port 8002).")
@click.option("--skip-metrics", is_flag=True, help="Skip the metrics check (the server's request counters grow by "
              "the requests validate sent).")
@click.option("--golden", default=None, metavar="MODEL", help="Reference model for the golden outputs (default: the "
              "model deploy recorded in the repository's manifest). " + MODEL_HELP)
@click.option("--load-test", is_flag=True, help="Also run a bounded concurrency sweep (TTFT, ITL, latency, tokens/s).")
@concurrency_option("Load-test concurrency levels.", "1,2,4,8", sweep=True)
@max_tokens_option()
@click.option("-o", "--output", "out", type=click.Path(path_type=Path), default=None,
              help="Report directory (default: validation/ beside REPO).")
@click.option("--timeout", type=float, default=600.0, show_default=True,
              help="Seconds to wait for the server to be ready.")
@price_option()
@device_option("the golden reference runs")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def validate(repo, url, api, served_model, grpc_url, metrics_url, skip_metrics, golden, load_test, concurrency,
             max_tokens, out, timeout, price_per_hour, device, as_json):
    """Serve REPO with Triton and verify it: readiness, configs, golden outputs, streaming, HTTP, bad requests,
    metrics.

    \b
    Exit status 0 only when every check passes; report.json (and load_test.png) go to the report directory.
    Examples:
      trtpipe validate out/smollm2/model_repo --golden smollm2-135m --load-test
      trtpipe validate model_repo --url http://gpu-box:8000
      trtpipe validate --url http://gpu-box:8000 --api openai --golden smollm2-135m
      trtpipe validate out/smollm2/model_repo --api openai
    """
    from ..validate import ValidateOptions, reference_for, render_report, validate_repository
    from ..validate.openai import validate_openai, validate_openai_repository

    if price_per_hour is not None and not load_test:
        raise UserError("--price-per-hour prices the load test's tokens: pass it with --load-test")
    if metrics_url and not url:
        raise UserError("--metrics-url is for a server given by --url (the embedded server's metrics port is known)")
    if metrics_url and skip_metrics:
        raise UserError("--metrics-url and --skip-metrics contradict each other; pass one")
    if api == "openai":
        triton_only = [flag for flag, given in (("--grpc-url", grpc_url), ("--metrics-url", metrics_url),
                                                ("--load-test", load_test)) if given]
        if triton_only:
            raise UserError(f"--api openai takes none of --grpc-url, --metrics-url, --load-test; got {triton_only}")
        if served_model and not url:
            raise UserError("--model names a model of the server at --url; the embedded front serves REPO's")
    elif served_model:
        raise UserError("--model names the model of an OpenAI-compatible server: pass it with --api openai")
    if repo is None and url is None:
        raise UserError("give a model repository to serve, or --url of a running server")
    out = out or (Path(repo).absolute().parent if repo else Path.cwd()) / "validation"
    options = ValidateOptions(golden=reference_for(repo, golden, device), load_test=load_test,
                              concurrencies=concurrency, max_tokens=max_tokens, metrics=not skip_metrics,
                              price_per_hour=price_per_hour)
    progress = lambda step: click.echo(f"... {step}", err=True)  # noqa: E731
    if api == "openai" and not url:
        report = validate_openai_repository(repo, out, options, ready_timeout=timeout, progress=progress)
    elif api == "openai":
        report = validate_openai(url, out, options, model=served_model, progress=progress)
    else:
        report = validate_repository(repo, out, options, url=url, grpc_url=grpc_url, metrics_url=metrics_url,
                                     ready_timeout=timeout, progress=progress)
    click.echo(json.dumps(report.to_dict(), indent=2) if as_json else render_report(report, out))
    sys.exit(0 if report.passed else 1)


@main.command()
@repository_argument()
@click.option("--port", type=click.IntRange(0, 65533), default=8000, show_default=True,
              help="HTTP port; gRPC uses PORT+1 and metrics PORT+2. 0 picks free ports.")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on (0.0.0.0 for all).")
@click.option("--log", "log_path", type=click.Path(path_type=Path), default=None,
              help="Server log file (default: a temporary file, removed on exit).")
@click.option("--timeout", type=float, default=600.0, show_default=True,
              help="Seconds to wait for every model to be ready.")
@click.option("--model-control-mode", "model_control", type=choice(MODEL_CONTROL_MODES), default="none",
              show_default=True, help="explicit: every model loaded at start and reloadable through Triton's "
              "model-control API, so `trtpipe versions serve --url` and `trtpipe tune --url` can switch it live.")
@click.option("--drain-timeout", type=click.FloatRange(0), default=30.0, show_default=True,
              help="On Ctrl-C or SIGTERM: seconds the requests in flight get to finish (new ones are refused); the "
                   "rest end with an error and the exit status is 1.")
@click.option("--openai", "openai", is_flag=True,
              help="Also serve the OpenAI-compatible API (/v1/models, /v1/completions, /v1/chat/completions with the "
              "repository's chat template, streaming with usage) over the ensemble, on --openai-port.")
@click.option("--openai-port", type=click.IntRange(0, 65535), default=None,
              help="Port of the OpenAI-compatible API (default 9000, Triton's OpenAI frontend's; 0 picks a free "
              "one). Implies --openai.")
@click.option("--url", default=None,
              help="With --openai: serve only the OpenAI API, over the Triton server at this HTTP URL serving REPO "
              "(a GPU image's tritonserver; the Kubernetes pod's openai container), instead of starting one.")
def serve(repo, port, host, log_path, timeout, model_control, drain_timeout, openai, openai_port, url):
    """The embedded Triton server on REPO, in the foreground until Ctrl-C or SIGTERM, which drain it.

    \b
    Examples:
      trtpipe serve out/smollm2/model_repo
      trtpipe serve out/smollm2/model_repo --openai     # and http://127.0.0.1:9000/v1
      trtpipe serve model_repo --port 8100 --host 0.0.0.0 --log triton.log
      trtpipe serve model_repo --model-control-mode explicit
      trtpipe serve model_repo --openai --url http://127.0.0.1:8000   # the API over a running Triton
    """
    from ..openai_front.protocol import DEFAULT_OPENAI_PORT
    from ..serve import serve_forever, serve_front_forever

    if openai and openai_port is None:
        openai_port = DEFAULT_OPENAI_PORT
    if url is not None:
        if openai_port is None:
            raise UserError("--url serves the OpenAI API over a running Triton: add --openai")
        ctx = click.get_current_context()
        triton_only = [f"--{name.replace('_', '-')}" for name in ("port", "log_path", "model_control", "drain_timeout")
                       if ctx.get_parameter_source(name) is not click.core.ParameterSource.DEFAULT]
        if triton_only:
            raise UserError(f"{', '.join(triton_only)} configure the Triton server trtpipe starts; with --url it "
                            "serves only the OpenAI API over yours (drop them)")
        serve_front_forever(repo, url.rstrip("/"), host=host, port=openai_port, ready_timeout=timeout,
                            echo=click.echo)
        return
    drained = serve_forever(repo, http_port=port or None, host=host, log_path=log_path, ready_timeout=timeout,
                            model_control=model_control, drain_timeout=drain_timeout, openai_port=openai_port,
                            echo=click.echo)
    if not drained.clean:
        click.echo(f"error: {drained.cut} request(s) were still running after the {drain_timeout:g} s drain and "
                   "ended with an error", err=True)
        sys.exit(1)
    click.echo("stopped" + (f": every request answered ({drained.waited_s:.1f} s of draining)"
                            if drained.cut == 0 else ""))


@main.command()
@click.option("--url", default="http://127.0.0.1:8000", show_default=True, help="The Triton server's HTTP URL.")
@click.option("--timeout", type=float, default=60.0, show_default=True,
              help="Seconds to wait for the answer (a slower one counts as alive: the server is busy).")
@json_option("the answer")
def probe(url, timeout, as_json):
    """Whether the served models still work: one token through the ensemble (exit 0), exit 1 when a model's
    process died or the server does not answer. Triton's /v2/health endpoints stay 200 when a Python model's
    process died, so the Kubernetes liveness probe trtpipe writes runs this.

    \b
    Examples:
      trtpipe probe
      trtpipe probe --url http://gpu-box:8000
    """
    from ..serve import model_problem

    problem = model_problem(url.rstrip("/"), timeout)
    if as_json:
        click.echo(json.dumps({"url": url, "alive": problem is None, "problem": problem}))
    elif problem:
        click.echo(f"error: {problem}", err=True)
    else:
        click.echo(f"{url}: the models answer")
    sys.exit(1 if problem else 0)


def _percent(ctx, param, value):
    from ..compare import parse_percent

    return None if value is None else parse_percent(value, f"--{param.name.replace('_', '-')}")


@main.command()
@click.argument("build_a", type=click.Path(path_type=Path))
@click.argument("build_b", type=click.Path(path_type=Path))
@click.option("--prompts", default=None, metavar="FILE|RECIPE",
              help="A text file (one prompt per line) or a recipe: heldout (default: the start of held-out news "
                   "documents) or validate (validate's four prompts).")
@click.option("--num-prompts", type=click.IntRange(1), default=16, show_default=True, help="Prompts to use at most.")
@max_tokens_option()
@click.option("--eval-samples", "ppl_samples", type=click.IntRange(1), default=16, show_default=True,
              help="Held-out documents the perplexity of each checkpoint is computed over.")
@click.option("--load-test", is_flag=True, help="Also measure TTFT/ITL/latency and tokens/s under the same load.")
@concurrency_option("Concurrent clients of the load test (the same for both).", 4)
@click.option("--requests-per-client", type=click.IntRange(1), default=4, show_default=True,
              help="Requests each load-test client sends, one after another.")
@click.option("--url-a", default=None, help="Use A's running Triton server instead of serving BUILD_A/model_repo.")
@click.option("--url-b", default=None, help="Use B's running Triton server instead of serving BUILD_B/model_repo.")
@click.option("--max-ppl-increase", callback=_percent, default=None, metavar="PCT",
              help="Fail when B's held-out perplexity is more than PCT above A's (e.g. 2%).")
@click.option("--min-token-agreement", type=float, default=None, help="Fail below this token agreement (0-1).")
@click.option("--min-rouge-l", type=float, default=None, help="Fail below this ROUGE-L F of B against A (0-1).")
@click.option("--min-bleu", type=float, default=None, help="Fail below this corpus BLEU of B against A (0-100).")
@click.option("--min-exact-match", type=float, default=None, help="Fail below this share of identical completions.")
@click.option("--min-throughput-speedup", type=float, default=None,
              help="With --load-test: fail when B's output tokens/s over A's is below this.")
@click.option("--max-p99-latency-increase", callback=_percent, default=None, metavar="PCT",
              help="With --load-test: fail when B's P99 request latency is more than PCT above A's.")
@click.option("--allow-different-tokenizer", is_flag=True,
              help="Compare builds of different models or tokenizers (refused otherwise: exit 2).")
@price_option()
@device_option("perplexity is computed")
@click.option("-o", "--output", "out", type=click.Path(path_type=Path), default=None,
              help="Report directory (default: compare-<A>-vs-<B>).")
@click.option("--force", is_flag=True, help="Replace an existing output directory.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def compare(build_a, build_b, prompts, num_prompts, max_tokens, ppl_samples, load_test, concurrency,
            requests_per_client, url_a, url_b, allow_different_tokenizer, price_per_hour, device, out, force, as_json,
            **limits):
    """Compare two builds of one model on the same prompts and load; exit 1 when B fails a threshold.

    Reports held-out perplexity, B's token agreement, ROUGE-L, BLEU and exact match against A's greedy
    completions, weights and planned memory per instance, and with --load-test TTFT/ITL/latency
    P50/P90/P99 and output tokens/s at one concurrency: report.json, report.md and report.png.

    \b
    Examples:
      trtpipe compare out/fp16 out/fp8 --max-ppl-increase 2% --min-rouge-l 0.85
      trtpipe compare out/fp16 out/fp8 --load-test --concurrency 8 -o ab-report
    """
    from ..compare import CompareOptions, Thresholds, compare_builds
    from ..compare.serving import ServeOptions

    if price_per_hour is not None and not load_test:
        raise UserError("--price-per-hour prices the load test's tokens: pass it with --load-test")
    out = out or Path(f"compare-{Path(build_a).name}-vs-{Path(build_b).name}")
    if out.exists() and any(out.iterdir()) and not force:
        raise UserError(f"{out} exists and is not empty; pass --force to replace it, or another -o")
    options = CompareOptions(
        build_a, build_b, out, thresholds=Thresholds(**limits),
        serve=ServeOptions(max_tokens=max_tokens, load_test=load_test, concurrency=concurrency,
                           requests_per_client=requests_per_client, price_per_hour=price_per_hour),
        prompts=prompts, num_prompts=num_prompts, ppl_samples=ppl_samples, url_a=url_a, url_b=url_b,
        allow_different_tokenizer=allow_different_tokenizer, device=device)
    report = compare_builds(options, say=lambda m: click.echo(m, err=True))
    if as_json:
        click.echo(json.dumps(report.to_dict(), indent=2))
    else:
        click.echo(report.markdown().split("\n## Completions")[0])
        click.echo(f"report: {out}/report.json, report.md, report.png")
    sys.exit(0 if report.passed else 1)


@main.command()
@click.argument("build_or_repo", metavar="BUILD_OR_REPO", type=click.Path(path_type=Path))
@click.option("--slo", required=True, metavar="CLAUSES",
              help='Bounds every trial is judged by, e.g. "ttft_p99<=500ms,itl_p99<=50ms": ttft/itl/latency at '
                   "p50/p90/p99 (<=, with us/ms/s), output_tokens_per_s (>=), joules_per_token (<=, with j or mj; "
                   "needs a readable energy counter).")
@click.option("--trials", type=click.IntRange(1), default=8, show_default=True,
              help="Trials to serve in the study (a resumed study runs up to this many in all).")
@concurrency_option("The load's concurrency sweep.", "1,4,8", sweep=True)
@click.option("--requests-per-client", type=click.IntRange(1), default=2, show_default=True,
              help="Requests each client of a load level sends, one after another.")
@max_tokens_option()
@click.option("--prompts", default=None, metavar="FILE|RECIPE",
              help="heldout (default: held-out calibration-corpus documents), validate, or a file of prompts.")
@click.option("--num-prompts", type=click.IntRange(1), default=16, show_default=True, help="Prompts to use at most.")
@click.option("--load-generator", type=choice(["builtin", "aiperf"]), default="builtin", show_default=True,
              help="What sends the load: trtpipe's own client, or NVIDIA's aiperf (its own environment).")
@click.option("--url", default=None, help="A running Triton with --model-control-mode=explicit serving the "
              "repository: each trial's configs are loaded into it (GPU targets need it).")
@click.option("--rebuild", is_flag=True, help="GPU: also search the build's max_batch_size, max_num_tokens and "
              "multiple_profiles, compiling each trial's engine.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the TPE sampler.")
@price_option()
@click.option("--timeout", type=float, default=600.0, show_default=True, help="Seconds to wait for each server.")
@click.option("-o", "--output", "out", type=click.Path(path_type=Path), default=None,
              help="Study directory (default: BUILD/tune, or tune/ beside REPO); study.db resumes there.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
def tune(build_or_repo, out, as_json, trials, url, rebuild, seed, timeout, **load):
    """Search batching and serving parameters for the most output tokens/s within an SLO, by measurement.

    \b
    Each trial renders a candidate repository (the plan with the trial's values), serves it and runs the same
    load; Optuna's TPE (seeded, resumable in OUT/study.db) starts from the plan's configuration and the
    roofline's, never serves what the planner's memory model refuses, and prunes trials whose first load
    level already breaks the SLO. OUT/result/ gets trials.json/csv, tradeoff.png, importances.png and, when a
    trial meets the SLO, overlay.json, plan.json and model_repo/. Exit 1 when no trial meets the SLO.
    Examples:
      trtpipe tune out/smollm2 --slo "ttft_p99<=2s,itl_p99<=300ms" --trials 6
      trtpipe tune out/llama3 --slo "ttft_p99<=500ms,itl_p99<=50ms" --url http://gpu-box:8000
    """
    from ..tune import tune as run_tune
    from ..tune import tune_options
    from ..tune.stage import result_json

    options = tune_options(trials=trials, url=url, rebuild=rebuild, out=out, seed=seed, ready_timeout=timeout,
                           progress=not as_json, **load)
    result = run_tune(build_or_repo, options, say=lambda message: click.echo(message, err=as_json))
    click.echo(result_json(result) if as_json else result.render())
    sys.exit(0 if result.met else 1)


@main.command()
@repository_argument()
@click.option("--duration", type=click.FloatRange(min=0, min_open=True), default=10.0, show_default=True,
              help="Seconds of load captured.")
@concurrency_option("Concurrent clients.", 1)
@max_tokens_option()
@click.option("--top", type=click.IntRange(1), default=15, show_default=True, help="Operators in the table.")
@click.option("--capture-iterations", default="100-300", show_default=True, metavar="FIRST-LAST",
              help="GPU: the runtime iterations Nsight Systems captures (TensorRT-LLM's start/stop variable).")
@click.option("-o", "--output", "out", type=click.Path(path_type=Path), default=None,
              help="Trace directory (default: profile/ beside REPO).")
@click.option("--timeout", type=float, default=600.0, show_default=True,
              help="Seconds to wait for the server to be ready.")
@json_option("the load, the stages and the top operators")
def profile(repo, duration, concurrency, max_tokens, top, capture_iterations, out, timeout, as_json):
    """Serve REPO, drive validate's load for --duration seconds and leave a trace of where the time went.

    \b
    The cpu target: trace.json.gz (Chrome trace format: https://ui.perfetto.dev) with the stage ranges of every
    model (tokenize, schedule, forward, sample, detokenize) and torch's operators, top_operators.md and
    profile.json. A GPU repository: an Nsight Systems report (nsys profile -t cuda,nvtx,osrt, captured around
    the iterations --capture-iterations names) and nsys stats summaries; needs nsys on PATH.
    Examples:
      trtpipe profile out/smollm2-cpu-fp8/model_repo --duration 10
      trtpipe profile out/smollm2-cpu-fp8/model_repo --concurrency 4 -o prof
    """
    from ..profile import ProfileOptions, profile_repository
    from ..validate.report import DEFAULT_PROMPTS

    out = out or Path(repo).absolute().parent / "profile"
    options = ProfileOptions(duration_s=duration, concurrency=concurrency, max_tokens=max_tokens,
                             prompts=DEFAULT_PROMPTS, top=top, ready_timeout=timeout,
                             capture_iterations=capture_iterations)
    result = profile_repository(repo, out, options, say=lambda m: click.echo(f"... {m}", err=True))
    click.echo(json.dumps(result.to_dict(), indent=2) if as_json else result.render())


@main.command()
@click.option("--target", default="rtx4090", show_default=True, help="The GPU target this box should be "
              "(`trtpipe targets`).")
@click.option("--json", "as_json", is_flag=True, help="Print the checks as JSON.")
def doctor(target, as_json):
    """Check that this machine can build and serve TensorRT-LLM 1.2.1 engines for a GPU target.

    \b
    One line per check, PASS / FAIL / SKIP with what to do: nvidia-smi and the driver, the GPU's name,
    compute capability and memory against the target catalogue, TensorRT-LLM 1.2.1 importable,
    trtllm-build and tritonserver (with the tensorrtllm backend) on PATH, torch with CUDA.
    Exit status 0 when every check passes, 1 when one fails, 2 for an unknown or non-GPU target.
    Examples:
      trtpipe doctor
      trtpipe doctor --target l40s --json
    """
    from ..doctor import run_doctor

    report = run_doctor(target)
    click.echo(json.dumps(report.to_dict(), indent=2) if as_json else report.render())
    sys.exit(0 if report.ok else 1)
