"""The OpenAI-compatible front (pipeline/openai_front): its request rules as functions, then the real thing, SmolLM2's
cpu repository in the embedded Triton, driven by the official `openai` client and compared with the ensemble's own
generate endpoint; `trtpipe serve --openai` and `trtpipe validate REPO --api openai` through the CLI."""

from __future__ import annotations

import re
import signal
import subprocess
import sys

import openai
import pytest
import requests
from click.testing import CliRunner

from pipeline.cli import main
from pipeline.openai_front.protocol import (CHAT, COMPLETIONS, DEFAULT_MAX_TOKENS, OpenAIError, ServedModel,
                                            StopScanner, finish_reason, parse_request)
from pipeline.triton_names import ENSEMBLE_NAMES, TENSORRT_LLM_NAMES

MODELS = {"ensemble": ServedModel("ensemble", frozenset(ENSEMBLE_NAMES) | frozenset(TENSORRT_LLM_NAMES))}


def render(messages):
    return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"


def parse(body, endpoint=COMPLETIONS, models=MODELS):
    return parse_request(endpoint, body, models, render)


# ----------------------------------------------------------------------------------------- the request rules


def test_a_completion_becomes_the_ensemble_request_triton_s_frontend_sends():
    request = parse({"model": "ensemble", "prompt": "Hi", "max_tokens": 5, "temperature": 0, "top_p": 0.5,
                     "seed": 3, "stop": "\n", "stream": True, "stream_options": {"include_usage": True},
                     "frequency_penalty": 0.1, "presence_penalty": -0.2, "echo": True, "user": "me", "min_tokens": 2})
    assert request.ensemble_body() == {
        "text_input": "Hi", "max_tokens": 5, "exclude_input_in_output": False, "return_num_input_tokens": True,
        "return_num_output_tokens": True, "temperature": 0.0, "top_p": 0.5, "seed": 3, "frequency_penalty": 0.1,
        "presence_penalty": -0.2, "min_tokens": 2, "stop_words": ["\n"], "stream": True}
    assert request.include_usage and request.echo and request.stop == ("\n",)
    plain = parse({"model": "ensemble", "prompt": "Hi"})
    assert plain.max_tokens == DEFAULT_MAX_TOKENS and plain.ensemble_body()["exclude_input_in_output"] is True
    assert "temperature" not in plain.ensemble_body() and "stream" not in plain.ensemble_body()


def test_a_chat_is_rendered_once_by_the_template_and_max_completion_tokens_wins():
    request = parse({"model": "ensemble", "max_tokens": 3, "max_completion_tokens": 7,
                     "messages": [{"role": "system", "content": "Be brief."},
                                  {"role": "user", "content": [{"type": "text", "text": "a"},
                                                               {"type": "text", "text": "b"}]}]}, CHAT)
    assert request.prompt == "<system>Be brief.<user>ab<assistant>" and request.max_tokens == 7
    assert request.id.startswith("chatcmpl-") and request.chat


@pytest.mark.parametrize("endpoint, change, param, status", [
    (COMPLETIONS, {"n": 2}, "n", 400),
    (COMPLETIONS, {"best_of": 3}, "best_of", 400),
    (COMPLETIONS, {"logprobs": 1}, "logprobs", 400),
    (CHAT, {"logprobs": True}, "logprobs", 400),
    (CHAT, {"top_logprobs": 2}, "top_logprobs", 400),
    (COMPLETIONS, {"logit_bias": {"5": 1}}, "logit_bias", 400),
    (COMPLETIONS, {"suffix": "end"}, "suffix", 400),
    (CHAT, {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", 400),
    (CHAT, {"tool_choice": "auto"}, "tool_choice", 400),
    (CHAT, {"response_format": {"type": "json_object"}}, "response_format", 400),
    (COMPLETIONS, {"metadata": {"a": "b"}}, "metadata", 400),
    (CHAT, {"echo": True}, "echo", 400),
    (COMPLETIONS, {"stream_options": {"include_usage": True}}, "stream_options", 400),
    (COMPLETIONS, {"prompt": ["a", "b"]}, "prompt", 400),
    (COMPLETIONS, {"prompt": [1, 2]}, "prompt", 400),
    (COMPLETIONS, {"prompt": ""}, "prompt", 400),
    (COMPLETIONS, {"model": None}, "model", 400),
    (COMPLETIONS, {"model": "gpt-4"}, "model", 404),
    (COMPLETIONS, {"max_tokens": 0}, "max_tokens", 400),
    (COMPLETIONS, {"max_tokens": "sixteen"}, "max_tokens", 400),
    (COMPLETIONS, {"temperature": 2.5}, "temperature", 400),
    (COMPLETIONS, {"top_p": 1.5}, "top_p", 400),
    (COMPLETIONS, {"seed": -1}, "seed", 400),
    (COMPLETIONS, {"min_tokens": -1}, "min_tokens", 400),
    (COMPLETIONS, {"ignore_eos": True}, "ignore_eos", 400),
    (COMPLETIONS, {"stop": ["a", "b", "c", "d", "e"]}, "stop", 400),
    (COMPLETIONS, {"stream": "yes"}, "stream", 400),
    (CHAT, {"messages": [{"role": "tool", "content": "42"}]}, "messages", 400),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages", 400),
    (CHAT, {"messages": []}, "messages", 400),
])
def test_what_the_front_cannot_honour_is_refused_as_an_openai_error(endpoint, change, param, status):
    base = ({"model": "ensemble", "messages": [{"role": "user", "content": "Hi"}]} if endpoint == CHAT else
            {"model": "ensemble", "prompt": "Hi"})
    with pytest.raises(OpenAIError) as refused:
        parse({**base, **change}, endpoint)
    assert refused.value.status == status and refused.value.param == param
    body = refused.value.body()["error"]
    assert body["message"] and body["type"] == ("not_found_error" if status == 404 else "invalid_request_error")


@pytest.mark.parametrize("change", [{"n": 1}, {"logprobs": None}, {"logprobs": 0}, {"tools": []},
                                    {"response_format": {"type": "text"}}, {"best_of": 1}, {"suffix": None}])
def test_fields_at_the_value_that_asks_for_nothing_are_accepted(change):
    assert parse({"model": "ensemble", "prompt": "Hi", **change}).prompt == "Hi"


def test_a_field_whose_input_the_model_lacks_is_refused_not_dropped():
    bare = {"bls": ServedModel("bls", frozenset({"text_input", "max_tokens", "text_output"}))}
    assert parse({"model": "bls", "prompt": "Hi"}, models=bare).model == "bls"
    with pytest.raises(OpenAIError, match=r"does not take \['seed'\]"):
        parse({"model": "bls", "prompt": "Hi", "seed": 1}, models=bare)
    with pytest.raises(OpenAIError, match="stop_words"):
        parse({"model": "bls", "prompt": "Hi", "stop": "x"}, models=bare)


def test_stop_sequences_cut_the_text_before_them_even_across_streamed_pieces():
    scanner = StopScanner(("END", "\n\n"))
    sent = [scanner.feed(piece) for piece in ("Hello", " E", "N", "ough", " wor", "ld\n", "\nmore")]
    assert "".join(sent) == "Hello ENough world" and scanner.stopped
    assert sent[1:4] == [" ", "", "ENough"]   # "E" held back while it could start "END"
    scanner = StopScanner(("END",))
    assert scanner.feed("no E") == "no " and not scanner.stopped and scanner.flush() == "E"
    assert StopScanner(()).feed("as is") == "as is"


def test_the_finish_reason_is_length_only_when_max_tokens_ran_out():
    assert finish_reason(False, 8, 8) == "length"
    assert finish_reason(True, 8, 8) == "stop"
    assert finish_reason(False, 3, 8) == "stop"
    assert finish_reason(False, None, 8) == "stop"


# ------------------------------------------------------------------ SmolLM2's cpu repository, the real front


@pytest.fixture(scope="module")
def smollm2_front(smollm2_checkpoint, tmp_path_factory, triton_pool):
    """deploy's five-model cpu repository for SmolLM2 (float32) in the embedded server, the front beside it."""
    from pipeline.deploy import deploy_repository
    from pipeline.openai_front.app import OpenAIFront
    from pipeline.plan import resolve_model_info
    from pipeline.planner import make_plan
    from pipeline.targets import get_target

    plan = make_plan(resolve_model_info("smollm2-135m"), get_target("cpu"), "fp32")
    repo = deploy_repository(plan, tmp_path_factory.mktemp("openai") / "repo", checkpoint=smollm2_checkpoint).path
    server = triton_pool.get(repo)
    with OpenAIFront(repo, server.http_url, port=0) as front:
        yield repo, server, front, openai.OpenAI(base_url=f"{front.url}/v1", api_key="unused", max_retries=0)


def ensemble_text(server, prompt: str, max_tokens: int) -> dict:
    body = {"text_input": prompt, "max_tokens": max_tokens, "temperature": 0.0, "exclude_input_in_output": True,
            "return_num_input_tokens": True, "return_num_output_tokens": True}
    answer = requests.post(f"{server.http_url}/v2/models/ensemble/generate", json=body, timeout=120)
    assert answer.status_code == 200, answer.text
    return answer.json()


def tokenizer_of(repo):
    from transformers import AutoTokenizer

    from pipeline.model_repository import read_repository

    return AutoTokenizer.from_pretrained(str(read_repository(repo).tokenizer))


@pytest.mark.slow
def test_completions_streamed_or_not_equal_the_ensemble_s_greedy_text(smollm2_front):
    repo, server, front, client = smollm2_front
    assert [m.id for m in client.models.list()] == ["ensemble", "tensorrt_llm_bls"]
    for prompt in ("The capital of France is", "Water boils at"):
        expected = ensemble_text(server, prompt, 12)
        answer = client.completions.create(model="ensemble", prompt=prompt, max_tokens=12, temperature=0)
        assert answer.choices[0].text == expected["text_output"]
        assert answer.choices[0].finish_reason == "length"
        assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (
            len(tokenizer_of(repo)(prompt)["input_ids"]), 12)
        chunks = list(client.completions.create(model="ensemble", prompt=prompt, max_tokens=12, temperature=0,
                                                stream=True, stream_options={"include_usage": True}))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == expected["text_output"]
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


@pytest.mark.slow
def test_a_chat_applies_the_repository_s_chat_template_once(smollm2_front):
    repo, server, front, client = smollm2_front
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    rendered = tokenizer_of(repo).apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    expected = ensemble_text(server, rendered, 24)
    answer = client.chat.completions.create(model="ensemble", messages=messages, max_tokens=24, temperature=0)
    assert answer.choices[0].message.content == expected["text_output"] and answer.choices[0].message.role == \
        "assistant"
    # the template once: the prompt the model saw is exactly the rendered conversation's tokens
    assert answer.usage.prompt_tokens == expected["num_input_tokens"] == len(tokenizer_of(repo)(rendered)["input_ids"])
    chunks = list(client.chat.completions.create(model="ensemble", messages=messages, max_tokens=24, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected["text_output"]
    assert chunks[-1].usage.prompt_tokens == answer.usage.prompt_tokens


@pytest.mark.slow
def test_stop_sequences_are_honoured_streamed_or_not(smollm2_front):
    repo, server, front, client = smollm2_front
    whole = ensemble_text(server, "The capital of France is", 16)["text_output"]
    assert "." in whole
    cut = whole[:whole.index(".")]
    answer = client.completions.create(model="ensemble", prompt="The capital of France is", max_tokens=16,
                                       temperature=0, stop=["."])
    assert (answer.choices[0].text, answer.choices[0].finish_reason) == (cut, "stop")
    chunks = list(client.completions.create(model="ensemble", prompt="The capital of France is", max_tokens=16,
                                            temperature=0, stop=["."], stream=True))
    assert "".join(c.choices[0].text for c in chunks) == cut and chunks[-1].choices[0].finish_reason == "stop"


@pytest.mark.slow
def test_refusals_are_openai_errors_and_the_server_serves_afterwards(smollm2_front):
    repo, server, front, client = smollm2_front
    cases = [(openai.BadRequestError, dict(n=2)), (openai.BadRequestError, dict(logprobs=2)),
             (openai.NotFoundError, dict(model="gpt-4")), (openai.BadRequestError, dict(temperature=-1)),
             (openai.BadRequestError, dict(extra_body={"guided_json": {}}))]
    for error, change in cases:
        with pytest.raises(error) as refused:
            client.completions.create(**{"model": "ensemble", "prompt": "Hi", "max_tokens": 4, **change})
        assert refused.value.body["message"] and refused.value.status_code in (400, 404)
    for stream in (False, True):   # the model's own refusal, streamed or not: an HTTP 400 before any event
        with pytest.raises(openai.BadRequestError, match="min_tokens|max_tokens|exceeds|input"):
            client.completions.create(model="ensemble", prompt="Hi " * 9000, max_tokens=4, stream=stream)
    with pytest.raises(openai.BadRequestError, match="tool-call parser"):
        client.chat.completions.create(model="ensemble", messages=[{"role": "user", "content": "Hi"}],
                                       tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}])
    assert requests.post(f"{front.url}/v1/completions", data="{not json", timeout=10).json()["error"]["message"]
    assert requests.get(f"{front.url}/v1/nothing", timeout=10).json()["error"]["type"] == "not_found_error"
    assert client.completions.create(model="ensemble", prompt="Hi", max_tokens=2).choices[0].text


@pytest.mark.slow
def test_validate_api_openai_passes_every_check_on_the_front(smollm2_front, tmp_path):
    from pipeline.validate import ValidateOptions, reference_for
    from pipeline.validate.openai import validate_openai

    repo, server, front, client = smollm2_front
    report = validate_openai(front.url, tmp_path / "v", ValidateOptions(golden=reference_for(repo, None),
                                                                        max_tokens=8))
    assert report.passed, [(c.name, c.detail) for c in report.checks if not c.passed]
    assert [c.name for c in report.checks] == ["health", "golden", "streaming", "chat", "bad_requests"]


# ------------------------------------------------------------------------------------------------ the CLI


@pytest.mark.slow
def test_serve_openai_serves_both_apis_and_stops_cleanly(tiny_llama, tmp_path):
    """The tiny word-tokenizer repository: completions equal the ensemble's; its tokenizer has no chat template,
    so a chat is refused with the reason."""
    from support.models import deploy_tiny_cpu_repo

    repo = deploy_tiny_cpu_repo(tiny_llama("gqa"), tmp_path)
    process = subprocess.Popen([sys.executable, "-m", "pipeline.cli", "serve", str(repo), "--port", "0",
                                "--openai-port", "0"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines = []
        while "Ctrl-C to stop" not in "".join(lines) and process.poll() is None:
            lines.append(process.stdout.readline())
        output = "".join(lines)
        triton, front = re.search(r"HTTP\s+(\S+)", output).group(1), re.search(r"openai\s+(\S+)", output).group(1)
        client = openai.OpenAI(base_url=front, api_key="unused", max_retries=0)
        body = {"text_input": " w5 w6", "max_tokens": 6, "temperature": 0.0, "exclude_input_in_output": True}
        expected = requests.post(f"{triton}/v2/models/ensemble/generate", json=body, timeout=60).json()
        answer = client.completions.create(model="ensemble", prompt=" w5 w6", max_tokens=6, temperature=0)
        assert answer.choices[0].text == expected["text_output"]
        with pytest.raises(openai.BadRequestError, match="no chat template"):
            client.chat.completions.create(model="ensemble", messages=[{"role": "user", "content": " w1"}])
        # the front alone over that Triton: what a GPU image and the Kubernetes pod's openai container run
        alone = subprocess.Popen([sys.executable, "-m", "pipeline.cli", "serve", str(repo), "--openai-port", "0",
                                  "--url", triton], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            line = ""
            while "openai" not in line and alone.poll() is None:
                line = alone.stdout.readline()
            second = openai.OpenAI(base_url=re.search(r"openai\s+(\S+)", line).group(1), api_key="unused",
                                   max_retries=0)
            answer = second.completions.create(model="ensemble", prompt=" w5 w6", max_tokens=6, temperature=0)
            assert answer.choices[0].text == expected["text_output"]
        finally:
            alone.send_signal(signal.SIGTERM)
            rest = alone.communicate(timeout=60)[0]
        assert alone.returncode == 0 and "stopping" in rest, rest
    finally:
        process.send_signal(signal.SIGINT)
        rest = process.communicate(timeout=120)[0]
    assert process.returncode == 0, rest


@pytest.mark.parametrize("args, message", [
    (["--url", "http://127.0.0.1:9"], "add --openai"),
    (["--openai", "--url", "http://127.0.0.1:9", "--port", "8100"], "--port configure the Triton server"),
    (["--openai", "--url", "http://127.0.0.1:9", "--timeout", "0.5"], "was not ready within 0.5 s"),
])
def test_serve_with_url_refuses_what_it_cannot_honour(tiny_llama, tmp_path, args, message):
    from support.models import deploy_tiny_cpu_repo

    repo = deploy_tiny_cpu_repo(tiny_llama("gqa"), tmp_path)
    result = CliRunner().invoke(main, ["serve", str(repo), *args])
    assert result.exit_code == 2 and message in result.output, result.output


@pytest.mark.slow
def test_validate_api_openai_without_url_serves_the_repository_behind_the_front(smollm2_front, tmp_path):
    repo = smollm2_front[0]
    result = CliRunner().invoke(main, ["validate", str(repo), "--api", "openai", "--max-tokens", "8",
                                       "-o", str(tmp_path / "v")])
    assert result.exit_code == 0, result.output
    assert "all checks passed" in result.output and (tmp_path / "v" / "report.json").exists()
    refused = CliRunner().invoke(main, ["validate", str(repo), "--api", "openai", "--model", "x"])
    assert refused.exit_code == 2 and "--model names a model of the server at --url" in refused.output
