"""The validate checks (pipeline.validate) against a real tritonserver on tests/fixtures_repo and broken variants."""

from __future__ import annotations

import json
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest
from click.testing import CliRunner
from google.protobuf import text_format
from support.http import EmptyStreamTriton, serving
from tritonclient.grpc import model_config_pb2

from pipeline.cli import main
from pipeline.server import ServerPool, free_port
from pipeline.tritonconfig import parse_pbtxt
from pipeline.validate import (
    CheckResult,
    ValidateOptions,
    ValidationReport,
    config_differences,
    reference_for,
    render_report,
    validate_repository,
)
from pipeline.validate.client import RequestFailed

FIXTURE_REPO = Path(__file__).parent / "fixtures_repo"


class ReverseEcho:
    """The golden reference for tiny_llm: the prompt's words in reverse order, cycled."""

    name = "reverse-echo"

    def __init__(self, exact: bool = True, wrong_after: int | None = None):
        self.exact = exact
        self.wrong_after = wrong_after  # make the reference disagree from this token on

    def complete(self, prompt: str, max_tokens: int) -> str:
        words = prompt.split()[::-1]
        tokens = [" " + words[i % len(words)] for i in range(max_tokens)]
        if self.wrong_after is not None:
            tokens[self.wrong_after:] = [" different"] * (max_tokens - self.wrong_after)
        return "".join(tokens)

    def complete_all(self, prompts: list[str], max_tokens: int) -> list[str]:
        return [self.complete(p, max_tokens) for p in prompts]

    def tokenize(self, text: str) -> list[str]:
        return text.split()

    def agreement(self, prompt: str, completion: str) -> tuple[int, int]:
        """The next word never depends on earlier output here, so teacher forcing is position by position."""
        mine, served = self.tokenize(self.complete(prompt, len(completion.split()))), self.tokenize(completion)
        return sum(a == b for a, b in zip(mine, served)), len(served)


def variant(tmp_path: Path, name: str, edit) -> Path:
    """A copy of the fixture repository whose tiny_llm config.pbtxt is changed by `edit(ModelConfig)`."""
    repo = tmp_path / name
    shutil.copytree(FIXTURE_REPO, repo)
    path = repo / "tiny_llm" / "config.pbtxt"
    config = parse_pbtxt(path.read_text())
    edit(config)
    path.write_text(text_format.MessageToString(config))
    return repo


def set_parameter(key: str, value: str):
    def edit(config):
        config.parameters[key].string_value = value
    return edit


def served(triton_pool: ServerPool, repo: Path) -> dict:
    """validate_repository's keywords for using the triton_pool's running server on `repo`."""
    server = triton_pool.get(repo)
    return {"url": server.http_url, "grpc_url": server.endpoints.grpc_url,
            "metrics_url": server.endpoints.metrics_url}


def checks_of(report) -> dict:
    return {check.name: check for check in report.checks}


def options(**overrides) -> ValidateOptions:
    return ValidateOptions(**{"golden": ReverseEcho(), "max_tokens": 8, "request_timeout": 30, **overrides})


# ---------------------------------------------------------------------------------------- a good repository


@pytest.fixture(scope="module")
def good_report(tmp_path_factory):
    out = tmp_path_factory.mktemp("validation") / "report"
    report = validate_repository(FIXTURE_REPO, out, options(load_test=True, concurrencies=(1, 4),
                                                            requests_per_client=2), ready_timeout=120)
    return report, out


def test_every_check_passes_on_a_good_repository(good_report):
    report, _ = good_report
    assert [c.name for c in report.checks] == ["models_ready", "config_matches", "golden", "streaming",
                                               "http_generate", "bad_requests", "load_test", "metrics"]
    failed = {c.name: c.detail for c in report.checks if not c.passed}
    assert not failed
    assert report.passed


def test_report_files_and_load_test_numbers(good_report):
    _, out = good_report
    saved = json.loads((out / "report.json").read_text())
    assert saved["passed"] is True and len(saved["checks"]) == 8
    assert saved["server_log"] == "report/server.log"   # relative to the directory holding the report's (issue 25)
    assert (out / "load_test.png").stat().st_size > 0
    assert "Started HTTPService" in (out / "server.log").read_text()
    recorded = json.loads((out / "load_test.json").read_text())
    assert recorded["measured_on"] is None   # the fixture repository was not written by deploy: no plan predicts
    for lv in recorded["levels"]:            # energy measured, or null with the reason (this VM: no counter)
        assert (lv["energy"]["joules"] is None) == bool(lv["energy"]["reason"])
        assert lv["energy"]["peak_memory_bytes"] > 0
    levels = recorded["levels"]
    assert [lv["concurrency"] for lv in levels] == [1, 4]
    assert all("predicted" not in lv for lv in levels)
    for level in levels:
        assert level["failed"] == level["shed"] == 0
        assert level["completed"] == level["requests"] == 2 * level["concurrency"]
        assert level["output_tokens"] == 8 * level["requests"]  # one streamed event per token
        assert 0 < level["ttft_ms"]["p50"] <= level["latency_ms"]["p50"] <= level["latency_ms"]["p99"]
        # tiny_llm sleeps 10 ms per step: the inter-token latency is at least that
        assert level["itl_ms"]["p50"] >= 9
        assert level["output_tokens_per_s"] == pytest.approx(level["output_tokens"] / level["wall_s"])


def test_streaming_check_saw_incremental_responses(good_report):
    streaming = checks_of(good_report[0])["streaming"]
    for case in streaming.data["cases"]:
        assert case["responses"] == 8 and case["spread_s"] > 0.05
        assert case["joined"] == case["non_streamed"]


def test_bad_requests_were_rejected_by_the_right_layer(good_report):
    outcomes = {o["request"]: o for o in checks_of(good_report[0])["bad_requests"].data["outcomes"]}
    assert all(o["rejected"] for o in outcomes.values())
    assert "exceeds the context" in outcomes["max_tokens far beyond the context"]["answer"]
    assert "no_such_input" in outcomes["unknown input"]["answer"]


@pytest.mark.parametrize("request_name, parameter, allowed", [
    ("negative temperature", "temperature", ">= 0"), ("top_p above 1", "top_p", "in (0, 1]"),
    ("negative top_k", "top_k", ">= 0")])
def test_each_bad_sampling_value_gets_400_naming_the_parameter_and_its_range(good_report, request_name, parameter,
                                                                             allowed):
    outcome = next(o for o in checks_of(good_report[0])["bad_requests"].data["outcomes"]
                   if o["request"] == request_name)
    assert outcome["rejected"]
    assert outcome["answer"].startswith("400: ") and f"{parameter} must be {allowed}" in outcome["answer"]


def test_the_metrics_check_counts_exactly_what_validate_sent(good_report):
    metrics = checks_of(good_report[0])["metrics"]
    assert metrics.passed, metrics.detail
    tally, grown = metrics.data["tally"], metrics.data["grown"]
    # every good request of every check, the load test's included; the bad ones the models refused
    # golden 4, streaming 2 x (gRPC + HTTP), http_generate 2, bad_requests' good one 1, load test 2 x (1 + 4)
    assert tally["succeeded"] == 4 + 2 * 2 + 2 + 1 + 2 * (1 + 4) and tally["unanswered"] == 0
    assert grown["nv_inference_request_success"] == tally["succeeded"]
    # refused by the models: max_tokens 0 and far beyond the context, the three out-of-range sampling values (an empty
    # prompt and top_p 0 are no longer bad requests: NVIDIA's backend answers both); by the frontend: wrong types,
    # missing, unknown
    assert tally["failed"] == 5 and tally["refused"] == 4
    assert grown["nv_inference_request_failure"] in (tally["failed"], 2 * tally["failed"])


# ------------------------------------------------------------------------------ each broken case is caught


def test_wrong_golden_output_fails_with_the_first_difference(triton_pool, tmp_path):
    report = validate_repository(FIXTURE_REPO, tmp_path / "out", options(golden=ReverseEcho(wrong_after=3)),
                                 **served(triton_pool, FIXTURE_REPO))
    golden = checks_of(report)["golden"]
    assert not golden.passed and not report.passed
    assert "0/4 greedy completions identical" in golden.detail and "different" in golden.detail
    assert golden.fix


def test_quantized_golden_reports_token_agreement(triton_pool, tmp_path):
    reference = ReverseEcho(exact=False, wrong_after=6)
    report = validate_repository(FIXTURE_REPO, tmp_path / "out", options(golden=reference),
                                 **served(triton_pool, FIXTURE_REPO))
    golden = checks_of(report)["golden"]
    assert golden.passed  # 6 of 8 tokens agree: 75% >= 70%
    assert golden.data["mean_token_agreement"] == pytest.approx(0.75)
    assert "greedy choice given the same prefix" in golden.detail
    reference = ReverseEcho(exact=False, wrong_after=4)
    report = validate_repository(FIXTURE_REPO, tmp_path / "out2", options(golden=reference),
                                 **served(triton_pool, FIXTURE_REPO))
    assert not checks_of(report)["golden"].passed  # 4 of 8: 50% < 70%


def test_no_reference_skips_golden_and_says_to_pass_one(triton_pool, tmp_path):
    """A repository from elsewhere has no model to compare with: a skip naming the flag, not a failed deployment."""
    report = validate_repository(FIXTURE_REPO, tmp_path / "out", options(golden=None),
                                 **served(triton_pool, FIXTURE_REPO))
    golden = checks_of(report)["golden"]
    assert golden.skipped and not golden.passed and not golden.failed
    assert "--golden" in golden.fix
    assert report.passed == all(c.passed for c in report.checks if c.name != "golden")


def test_config_that_differs_from_the_served_one_is_named(triton_pool, tmp_path):
    """The server runs the fixture; the repository given to validate says max_batch_size 4 and another delay."""
    def edit(config):
        config.max_batch_size = 4
        config.dynamic_batching.max_queue_delay_microseconds = 100

    other = variant(tmp_path, "edited", edit)
    report = validate_repository(other, tmp_path / "out", options(), **served(triton_pool, FIXTURE_REPO))
    check = checks_of(report)["config_matches"]
    assert not check.passed
    assert "tiny_llm: max_batch_size: repository 4, server 8" in check.detail
    assert "dynamic_batching.max_queue_delay_microseconds: repository 100, server 2000" in check.detail
    assert "ensemble" not in check.detail  # the unchanged model matches


def test_stream_that_arrives_in_one_piece_fails_streaming(triton_pool, tmp_path):
    repo = variant(tmp_path, "bulk", set_parameter("stream_mode", "bulk"))
    report = validate_repository(repo, tmp_path / "out", options(), **served(triton_pool, repo))
    check = checks_of(report)["streaming"]
    assert not check.passed and "did not arrive incrementally" in check.detail
    assert checks_of(report)["golden"].passed  # only streaming is broken


def test_model_that_accepts_bad_requests_fails(triton_pool, tmp_path):
    repo = variant(tmp_path, "lenient", set_parameter("validate_inputs", "false"))
    report = validate_repository(repo, tmp_path / "out", options(), **served(triton_pool, repo))
    check = checks_of(report)["bad_requests"]
    assert not check.passed
    accepted = {o["request"] for o in check.data["outcomes"] if not o["rejected"]}
    assert accepted == {"max_tokens 0", "max_tokens far beyond the context",
                        "negative temperature", "top_p above 1", "negative top_k"}
    assert check.data["healthy_after"]


# ------------------------------------------------------------------------------------ overload and metrics


@pytest.fixture(scope="module")
def small_queue_server(triton_pool, tmp_path_factory):
    """The fixture with one request executing and one queued at most (0.4 s per 8-token request)."""
    def edit(config):
        config.max_batch_size = 1
        config.dynamic_batching.ClearField("preferred_batch_size")
        config.dynamic_batching.default_queue_policy.max_queue_size = 1
        config.parameters["seconds_per_step"].string_value = "0.05"

    repo = variant(tmp_path_factory.mktemp("overload"), "small_queue", edit)
    ensemble = parse_pbtxt((repo / "ensemble" / "config.pbtxt").read_text())
    ensemble.max_batch_size = 1  # an ensemble may not batch more than its steps
    (repo / "ensemble" / "config.pbtxt").write_text(text_format.MessageToString(ensemble))
    return triton_pool.get(repo)


def test_triton_sheds_a_full_queue_with_503_from_a_model_but_400_through_the_ensemble(small_queue_server):
    """What the client must cope with (Triton 2.51): the ensemble turns the composing model's 503 into 400."""
    import requests

    from pipeline.validate.client import QUEUE_FULL

    def statuses(model: str) -> dict[int, str]:
        post = lambda _: requests.post(f"{small_queue_server.http_url}/v2/models/{model}/generate",  # noqa: E731
                                       json={"text_input": "a b c", "max_tokens": 8}, timeout=30)
        with ThreadPoolExecutor(6) as threads:
            return {r.status_code: r.text for r in threads.map(post, range(6))}

    model, ensemble = statuses("tiny_llm"), statuses("ensemble")
    assert 200 in model and 200 in ensemble
    assert 503 in model and QUEUE_FULL in model[503] and 400 not in model
    assert 400 in ensemble and QUEUE_FULL in ensemble[400] and 503 not in ensemble


def test_the_client_and_the_load_test_report_overload_as_shed_not_failed(small_queue_server):
    from pipeline.validate import EnsembleClient, run_level
    from pipeline.validate.client import Overloaded

    client = EnsembleClient(small_queue_server, timeout=30)
    level = run_level(client, ("a b c",), max_tokens=8, concurrency=6, requests_per_client=1)
    assert level["shed"] >= 1 and level["failed"] == 0 and level["errors"] == []
    assert level["completed"] + level["shed"] == level["requests"] == 6
    assert client.tally.failed == level["shed"] and client.tally.succeeded == level["completed"]
    with ThreadPoolExecutor(6) as threads:
        outcomes = list(threads.map(lambda _: attempt(client), range(6)))
    assert "shed" in outcomes and "failed" not in outcomes
    with pytest.raises(RequestFailed) as refused:  # a bad request is still a failure, not an overload
        client.generate("", 4)
    assert not isinstance(refused.value, Overloaded)


def attempt(client) -> str:
    from pipeline.validate.client import Overloaded

    try:
        client.generate("a b c", 8)
        return "answered"
    except Overloaded:
        return "shed"
    except RequestFailed:
        return "failed"


# ------------------------------------------------------------------------------ a stream without any event


@pytest.mark.parametrize("contract", ["ensemble", "llmapi"])
def test_a_stream_without_any_event_is_a_failed_request_to_each_client_and_the_load_test(contract):
    """Triton's 200 without any event when no model answered (docs/upstream-facts.md §C): each contract's client
    reports a failed request, never an empty answer; the load test (validate's, and tune's builtin generator)
    counts it failed and says why; the tally leaves the metrics check room for Triton's success count."""
    from pipeline.validate import EnsembleClient, run_level
    from pipeline.validate.client import EMPTY_STREAM, Tally
    from pipeline.validate.llmapi import LlmapiClient

    with serving(EmptyStreamTriton) as url:
        client = (EnsembleClient(SimpleNamespace(http_url=url), timeout=10) if contract == "ensemble"
                  else LlmapiClient(url, timeout=10))
        streamed = client.generate_stream("a b c", 4)
        level = run_level(client, ("a b c",), max_tokens=4, concurrency=2, requests_per_client=2)
    assert streamed.error == EMPTY_STREAM and streamed.pieces == [] and not streamed.overloaded
    assert level["completed"] == level["shed"] == 0 and level["failed"] == level["requests"] == 4
    assert level["errors"] == [EMPTY_STREAM]
    assert client.tally == Tally(unclassified=5)


@pytest.mark.slow
def test_triton_answers_a_stream_no_model_answered_with_200_and_no_event(tiny_cpu_server):
    """docs/upstream-facts.md §C, Triton 2.51 on a repository trtpipe deployed: a request without text_input whose
    other inputs make up the ensemble's required count runs no model; generate_stream answers 200 without any event
    (generate: 200 with an error body) and Triton counts the ensemble's success. Too few inputs is the 400 naming
    text_input. validate's client reports a failed request, and its metrics check accepts Triton's count. This
    test fails when Triton's behaviour changes."""
    import requests

    from pipeline.validate import EnsembleClient
    from pipeline.validate.client import EMPTY_STREAM, Tally
    from pipeline.validate.metrics import FAILURE, SUCCESS, check_metrics, counts_before, read_counts

    url, body = f"{tiny_cpu_server.http_url}/v2/models/ensemble", {"max_tokens": 4, "stream": True}
    metrics_url = tiny_cpu_server.endpoints.metrics_url
    client = EnsembleClient(tiny_cpu_server, timeout=60)
    before = counts_before(metrics_url)
    streamed = client.generate_stream("", 4, body=body)
    assert streamed.error == EMPTY_STREAM and client.tally == Tally(unclassified=1)
    deadline = time.monotonic() + 10
    while (after := read_counts(metrics_url))[SUCCESS] == before[SUCCESS] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert (after[SUCCESS] - before[SUCCESS], after[FAILURE] - before[FAILURE]) == (1, 0)
    assert check_metrics(client, metrics_url, before).passed
    empty = requests.post(f"{url}/generate_stream", json=body, timeout=60)
    assert empty.status_code == 200 and empty.content == b""
    assert empty.headers["Content-Type"].startswith("text/event-stream")
    plain = requests.post(f"{url}/generate", json=body, timeout=60)
    assert plain.status_code == 200 and "expects model to produce exactly 1 response" in plain.json()["error"]
    few = requests.post(f"{url}/generate_stream", json={"max_tokens": 4}, timeout=60)
    assert few.status_code == 400 and "missing required input(s) ['text_input']" in few.text


def test_prometheus_text_is_parsed_and_the_ensembles_failures_summed_over_reasons():
    from pipeline.validate.metrics import MetricsUnavailable, ensemble_counts, parse_samples

    text = "\n".join([
        "# HELP nv_inference_request_success Number of successful inference requests, all batch sizes",
        "# TYPE nv_inference_request_success counter",
        'nv_inference_request_success{model="ensemble",version="1"} 21',
        'nv_inference_request_success{model="tiny_llm",version="1"} 30',
        'nv_inference_request_failure{model="ensemble",reason="OTHER",version="1"} 14',
        'nv_inference_request_failure{model="ensemble",reason="REJECTED",version="1"} 2 1700000000000',
        'nv_cpu_utilization{label="with \\"quotes\\", commas"} 0.5',
        "nv_pinned_memory_pool_total_bytes 268435456",
    ])
    samples = parse_samples(text)
    assert ("nv_cpu_utilization", {"label": 'with "quotes", commas'}, 0.5) in samples
    assert ("nv_pinned_memory_pool_total_bytes", {}, 268435456.0) in samples and len(samples) == 6
    assert ensemble_counts(text) == {"nv_inference_request_success": 21, "nv_inference_request_failure": 16}
    assert ensemble_counts(text, "tiny_llm") == {"nv_inference_request_success": 30, "nv_inference_request_failure": 0}
    with pytest.raises(MetricsUnavailable, match="no nv_inference_request_failure"):
        ensemble_counts(text.replace("nv_inference_request_failure", "other"))


class Tallied:
    """A client that has sent 5 good and 2 bad requests the ensemble refused."""

    model = "ensemble"

    def __init__(self):
        from pipeline.validate.client import Tally

        self.tally = Tally(succeeded=5, failed=2, refused=1)


@pytest.mark.parametrize("success, failure, passes", [(5, 2, True), (5, 4, True), (0, 0, False), (5, 0, False),
                                                     (6, 2, False), (5, 5, False)])
def test_the_metrics_check_fails_when_the_counters_do_not_grow_by_what_was_sent(monkeypatch, success, failure,
                                                                                passes):
    from pipeline.validate import metrics

    before = {metrics.SUCCESS: 10.0, metrics.FAILURE: 3.0}
    after = {metrics.SUCCESS: 10.0 + success, metrics.FAILURE: 3.0 + failure}
    monkeypatch.setattr(metrics, "read_counts", lambda url, model: after)
    monkeypatch.setattr(metrics, "SETTLE_S", 0.0)
    check = metrics.check_metrics(Tallied(), "http://h:8002", before)
    assert check.passed is passes, check.detail
    if not passes:
        assert "expected 5" in check.detail or "expected 2 to 4" in check.detail
        assert "--skip-metrics" in check.fix


def test_unreadable_metrics_fail_the_check_and_say_how_to_fix_it():
    from pipeline.validate import metrics

    before = metrics.counts_before(f"http://127.0.0.1:{free_port()}")
    assert isinstance(before, str) and "does not answer" in before
    check = metrics.check_metrics(Tallied(), None, before)
    assert not check.passed and "--metrics-url" in check.fix and "--skip-metrics" in check.fix


# -------------------------------------------------------------------------------------------- config diff


def test_config_differences_ignore_server_defaults_but_not_changes():
    expected = model_config_pb2.ModelConfig()
    text_format.Parse('name: "m" max_batch_size: 8 parameters { key: "a" value { string_value: "1" } } '
                      'input { name: "x" data_type: TYPE_INT32 dims: [ -1 ] }', expected)
    served = model_config_pb2.ModelConfig()
    served.CopyFrom(expected)
    served.default_model_filename = "model.py"  # filled in by the server
    served.parameters["b"].string_value = "2"
    assert config_differences(expected, served) == []
    served.input[0].dims[0] = 4
    served.parameters["a"].string_value = "9"
    del served.parameters["b"]
    assert config_differences(expected, served) == [
        "input[0].dims: repository [-1], server [4]",
        "parameters['a'].string_value: repository '1', server '9'",
    ]


# ------------------------------------------------------------------------------- report, helpers, package


def test_render_report_gives_one_line_per_check_and_the_fix_of_each_failure(tmp_path):
    report = ValidationReport("repo", "http://h:8000", [CheckResult("models_ready", True, "5 models ready"),
                                                         CheckResult("golden", False, "0/4 identical", fix="check it")])
    assert render_report(report, tmp_path).splitlines() == [
        "validated repo on http://h:8000",
        "  PASS  models_ready    5 models ready",
        "  FAIL  golden          0/4 identical",
        "        fix: check it",
        f"1 of 2 checks failed; report: {tmp_path / 'report.json'}",
    ]


def test_grpc_url_defaults_to_the_http_port_plus_one():
    from pipeline.validate.stage import default_grpc_url

    assert default_grpc_url("http://gpu-box:8000/") == "gpu-box:8001"
    assert default_grpc_url("localhost") == "localhost:8001"


def test_no_golden_reference_without_golden_or_a_deploy_manifest(tmp_path):
    assert reference_for(tmp_path, None) is None
    assert reference_for(None, None) is None


def test_the_golden_reference_takes_precision_and_dtype_from_deploys_record(tmp_path, monkeypatch):
    """`trtpipe validate REPO` reads the manifest's `deployment`, nothing inside the models' folders."""
    from dataclasses import asdict

    import pipeline.golden
    from pipeline.deploy import STAGE, Deployment
    from pipeline.validate import golden_reference

    made = []
    monkeypatch.setattr(pipeline.golden.GoldenReference, "from_spec",
                        classmethod(lambda cls, spec, **kw: made.append((spec, kw)) or spec))
    record = Deployment(model="smollm2-135m", precision="fp8", backend="reference", target="cpu",
                        weights_dtype="float16")
    (tmp_path / "manifest.json").write_text(json.dumps({"stage": STAGE, "deployment": asdict(record)}))
    assert reference_for(tmp_path, None) == "smollm2-135m"
    assert reference_for(tmp_path, "other-model") == "other-model"
    assert made == [(spec, {"exact": False, "weights_dtype": "float16", "device": "auto"})
                    for spec in ("smollm2-135m", "other-model")]
    made.clear()
    assert golden_reference("m", precision="bf16", weights_dtype="bfloat16", device="cpu") == "m"
    assert golden_reference(None, precision="fp16", weights_dtype="float16") is None
    assert made == [("m", {"exact": True, "weights_dtype": "bfloat16", "device": "cpu"})]


def test_the_package_exports_what_the_cli_build_and_benchmarks_import():
    from pipeline import validate

    for name in ("DEFAULT_PROMPTS", "EnsembleClient", "run_level", "ValidateOptions", "golden_reference",
                 "reference_for", "render_report", "validate_repository"):
        assert name in validate.__all__ and hasattr(validate, name)


# ---------------------------------------------------------------------------------------------- the CLI


def test_cli_validate_exits_1_and_writes_the_report_when_a_check_fails(triton_pool, tmp_path, monkeypatch):
    import pipeline.validate.stage as stage

    failed = CheckResult("golden", False, "0/4 identical", fix="pass --golden MODEL (the model the repository was "
                         "built from)")
    monkeypatch.setattr(stage, "check_golden", lambda client, options: failed)
    server = triton_pool.get(FIXTURE_REPO)
    out = tmp_path / "validation"
    result = CliRunner().invoke(main, ["validate", str(FIXTURE_REPO), "--url", server.http_url, "--grpc-url",
                                       server.endpoints.grpc_url, "--metrics-url", server.endpoints.metrics_url,
                                       "-o", str(out), "--max-tokens", "4"])
    assert result.exit_code == 1, result.output
    assert "FAIL  golden" in result.output and "fix: pass --golden MODEL" in result.output
    assert "PASS  streaming" in result.output and "PASS  bad_requests" in result.output
    assert "PASS  metrics" in result.output
    assert json.loads((out / "report.json").read_text())["passed"] is False


def test_cli_validate_without_metrics_fails_the_check_unless_skipped(triton_pool, tmp_path):
    server = triton_pool.get(FIXTURE_REPO)
    args = ["validate", str(FIXTURE_REPO), "--url", server.http_url, "--grpc-url", server.endpoints.grpc_url,
            "--max-tokens", "2"]
    result = CliRunner().invoke(main, [*args, "--metrics-url", f"127.0.0.1:{free_port()}", "-o", str(tmp_path / "a")])
    assert result.exit_code == 1 and "FAIL  metrics" in result.output and "does not answer" in result.output
    assert "--skip-metrics" in result.output
    result = CliRunner().invoke(main, [*args, "--skip-metrics", "-o", str(tmp_path / "b")])
    assert "metrics" not in result.output.replace("--metrics", "")
    assert "metrics" not in {c["name"] for c in json.loads((tmp_path / "b" / "report.json").read_text())["checks"]}


@pytest.mark.parametrize("args, message", [
    (["nope"], "does not exist"),
    (["repo", "--metrics-url", "http://h:8002"], "--metrics-url is for a server given by --url"),
    (["repo", "--url", "http://h:8000", "--metrics-url", "http://h:8002", "--skip-metrics"], "contradict"),
])
def test_cli_validate_bad_input_is_exit_2(tmp_path, args, message):
    (tmp_path / "repo").mkdir()
    result = CliRunner().invoke(main, ["validate", str(tmp_path / args[0]), *args[1:], "-o", str(tmp_path / "v")])
    assert result.exit_code == 2
    assert message in result.output
    assert not (tmp_path / "v").exists()


# ------------------------------------------------------------------ the real SmolLM2 cpu deployment (deploy)


@pytest.fixture(scope="module")
def smollm2_report(smollm2_checkpoint, tmp_path_factory):
    """deploy's five-model cpu repository for SmolLM2, validated against transformers (reference from the plan)."""
    from pipeline.deploy import deploy_repository
    from pipeline.plan import resolve_model_info
    from pipeline.planner import make_plan
    from pipeline.targets import get_target

    root = tmp_path_factory.mktemp("smollm2-validate")
    plan = make_plan(resolve_model_info("smollm2-135m"), get_target("cpu"), "fp32")
    repo = deploy_repository(plan, root / "repo", checkpoint=smollm2_checkpoint).path
    reference = reference_for(repo, None)  # found through the deployment deploy recorded in the manifest
    report = validate_repository(repo, root / "validation", ValidateOptions(
        golden=reference, max_tokens=8, load_test=True, concurrencies=(1, 4), requests_per_client=1))
    return report, root / "validation"


@pytest.mark.slow
def test_smollm2_cpu_repository_serves_nvidia_clients_and_matches_transformers(smollm2_report):
    report, out = smollm2_report
    checks = checks_of(report)
    assert checks["models_ready"].passed and set(checks["models_ready"].data["states"]) == {
        "ensemble", "preprocessing", "tensorrt_llm", "postprocessing", "tensorrt_llm_bls"}
    for name in ("config_matches", "golden", "streaming", "http_generate", "load_test", "metrics"):
        assert checks[name].passed, f"{name}: {checks[name].detail}"
    assert checks["golden"].data["mean_token_agreement"] == 1.0
    assert "transformers" in checks["golden"].detail
    assert (out / "load_test.png").exists()


@pytest.mark.slow
def test_smollm2_cpu_repository_rejects_bad_requests(smollm2_report):
    check = checks_of(smollm2_report[0])["bad_requests"]
    assert check.passed, check.detail
    assert check.data["not_sent"] == []  # deploy's ensemble declares temperature, top_p and top_k
    answers = {o["request"]: o["answer"] for o in check.data["outcomes"]}
    for request, message in (("negative temperature", "temperature must be >= 0"),
                             ("top_p above 1", "top_p must be <= 1"),
                             ("negative top_k", "top_k must be >= 0")):
        assert answers[request].startswith("400: ") and message in answers[request], answers[request]
