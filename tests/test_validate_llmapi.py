"""`trtpipe validate` on an llmapi-layout repository (the cpu target's `reference-llmapi` backend), live: one
embedded Triton per module serves the deployed repository, and validate connects to it with --url.

validate tells the layout from deploy's record (the backend's `layout`) and runs the shared checks through
the llmapi contract (`text_input` + `sampling_param_*`, `streaming`): the good repository passes every
check; a repository whose config.pbtxt differs from what the server serves fails config_matches only, and a
golden reference of another model fails golden only.
"""

from __future__ import annotations

import json
import shutil

import pytest
from click.testing import CliRunner

from pipeline.cli import main
from support.models import deploy_tiny_llmapi, save_word_tokenizer

LLMAPI_CHECKS = ["models_ready", "config_matches", "golden", "streaming", "bad_requests", "load_test", "metrics"]


def hf_with_tokenizer(source, out):
    """The tiny Hugging Face model with the word tokenizer beside it: a golden reference for the repository."""
    shutil.copytree(source, out)
    save_word_tokenizer(out)
    return out


def test_the_word_tokenizer_knows_every_word_and_streams_them_back(tmp_path):
    """The tiny models' tokenizer: distinct prompts are distinct ids (not all unknown), and tokens decoded one by
    one join up to the text, as streaming needs."""
    from transformers import AutoTokenizer

    save_word_tokenizer(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    ids = tokenizer(" w5 w6 w17")["input_ids"]
    assert ids == [5, 6, 17] and tokenizer("w5 w6 w17")["input_ids"] == ids
    assert "".join(tokenizer.decode([i]) for i in ids) == tokenizer.decode(ids) == " w5 w6 w17"
    assert tokenizer("hello w3")["input_ids"] == [0, 3]        # unknown words: w0


@pytest.fixture(scope="module")
def served(checkpoint, tiny_llama, tmp_path_factory):
    """(repository, server endpoints, golden model directory, another model's directory)."""
    from pipeline.server import embedded_server

    tmp = tmp_path_factory.mktemp("validate-llmapi")
    golden = hf_with_tokenizer(tiny_llama("gqa"), tmp / "golden")
    repo = deploy_tiny_llmapi(checkpoint("gqa"), golden, tmp)
    with embedded_server(repo, ready_timeout=300) as server:
        yield repo, server.endpoints, golden, hf_with_tokenizer(tiny_llama("mha"), tmp / "other")


def validate(repo, endpoints, golden, out, *extra):
    result = CliRunner().invoke(main, ["validate", str(repo), "--url", endpoints.http_url, "--metrics-url",
                                       endpoints.metrics_url, "--golden", str(golden), "--max-tokens", "6",
                                       "--device", "cpu", "-o", str(out), "--json", *extra])
    return result, json.loads((out / "report.json").read_text())


def by_name(report) -> dict:
    return {check["name"]: check for check in report["checks"]}


def test_llmapi_repository_passes_every_check(served, tmp_path):
    repo, url, golden, _ = served
    result, report = validate(repo, url, golden, tmp_path / "report", "--load-test", "--concurrency", "1,3")
    assert result.exit_code == 0, result.output
    checks = by_name(report)
    assert list(checks) == LLMAPI_CHECKS and report["passed"]
    levels = checks["load_test"]["data"]["levels"]
    assert [lv["concurrency"] for lv in levels] == [1, 3]
    assert all(lv["completed"] == lv["requests"] and lv["output_tokens"] >= lv["requests"] for lv in levels)
    # the tensorrt_llm model's counters grew by the requests that succeeded, load test included, plus some of the
    # refused ones (the decoupled model's error responses count as successes or failures, the frontend's not at all)
    grown, tally = checks["metrics"]["data"]["grown"], checks["metrics"]["data"]["tally"]
    assert tally["succeeded"] >= sum(lv["requests"] for lv in levels) and tally["unclassified"] == 10
    assert tally["succeeded"] <= grown["nv_inference_request_success"]
    assert sum(grown.values()) <= tally["succeeded"] + tally["unclassified"]
    cases = checks["golden"]["data"]["cases"]
    assert all(c["identical"] and c["got"].strip() for c in cases)
    assert all(c["responses"] >= 2 and c["joined"] == c["non_streamed"] for c in checks["streaming"]["data"]["cases"])
    outcomes = checks["bad_requests"]["data"]["outcomes"]
    assert len(outcomes) == 10 and all(o["rejected"] for o in outcomes)
    named = {o["request"]: o["answer"] for o in outcomes}
    assert "sampling_param_top_p" in named["top_p above 1"] and "exceed max_seq_len 64" in \
        named["sampling_param_max_tokens far beyond the context"]


def test_a_config_the_server_does_not_serve_fails_config_matches_only(served, tmp_path):
    repo, url, golden, _ = served
    broken = tmp_path / "repo"
    shutil.copytree(repo, broken)
    config = broken / "tensorrt_llm" / "config.pbtxt"
    config.write_text(config.read_text().replace('name: "sampling_param_top_k"', 'name: "sampling_param_topk"'))
    result, report = validate(broken, url, golden, tmp_path / "report")
    assert result.exit_code == 1
    failed = [c for c in report["checks"] if not c["passed"]]
    assert [c["name"] for c in failed] == ["config_matches"] and "sampling_param_topk" in failed[0]["detail"]


def test_another_models_reference_fails_golden_only(served, tmp_path):
    repo, url, _, other = served
    result, report = validate(repo, url, other, tmp_path / "report")
    assert result.exit_code == 1
    failed = [c for c in report["checks"] if not c["passed"]]
    assert [c["name"] for c in failed] == ["golden"] and "identical to" in failed[0]["detail"]
