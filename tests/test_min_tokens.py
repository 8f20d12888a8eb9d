"""min_tokens as TensorRT-LLM implements it: the end id's logit is -inf until the output has min_tokens tokens
(penaltyKernels.cu batchApplyPenalty); stop words and max_tokens still end a request earlier."""

from __future__ import annotations

import json

import pytest
import requests
import torch

from pipeline.errors import UserError
from pipeline.runtime import ReferenceModel, SamplingConfig
from pipeline.runtime.generate import generate

END, FAVOURITE, VOCAB = 0, 3, 10


class EndFirstDecoder:
    """A Decoder whose logits always rank the end id first and FAVOURITE second."""

    def logits(self, rows: list[int]) -> torch.Tensor:
        out = torch.zeros(len(rows), VOCAB)
        out[:, END], out[:, FAVOURITE] = 5.0, 4.0
        return out

    def prefill(self, rows):
        return self.logits(rows)

    def decode(self, rows, tokens):
        return self.logits(rows)


def run(**config) -> list[int]:
    return generate(EndFirstDecoder(), [SamplingConfig(end_id=END, **config)], None)[0]


def test_the_end_id_waits_for_min_tokens():
    assert run(max_new_tokens=8) == []
    assert run(max_new_tokens=8, min_tokens=5) == [FAVOURITE] * 5   # the end id wins again at the 6th token


def test_min_tokens_0_and_1_do_not_constrain_as_upstream_for_one_request():
    assert run(max_new_tokens=8, min_tokens=0) == run(max_new_tokens=8, min_tokens=1) == []


def test_max_tokens_and_stop_words_still_end_a_request_before_min_tokens():
    assert run(max_new_tokens=3, min_tokens=5) == [FAVOURITE] * 3
    assert run(max_new_tokens=8, min_tokens=5, stop_words=[[FAVOURITE]]) == [FAVOURITE]


def test_sampling_never_draws_the_end_id_before_min_tokens():
    for seed in range(20):
        out = run(max_new_tokens=12, min_tokens=6, top_k=0, temperature=1.0, seed=seed)
        assert len(out) >= 6 and END not in out


@pytest.mark.parametrize("value", [-1, 2.5])
def test_bad_min_tokens_is_a_user_error(value):
    with pytest.raises(UserError, match="min_tokens must be an integer >= 0"):
        SamplingConfig(min_tokens=value)


def test_reference_runtime_honours_min_tokens(checkpoint):
    """A tiny random model whose greedy first token is made the end id."""
    model = ReferenceModel.load(checkpoint("gqa"))
    prompt = [5, 6, 7, 8]
    first = model.generate([prompt], SamplingConfig(max_new_tokens=1))[0][0]
    assert model.generate([prompt], SamplingConfig(max_new_tokens=8, end_id=first)) == [[]]
    out = model.generate([prompt], SamplingConfig(max_new_tokens=12, end_id=first, min_tokens=4))[0]
    assert len(out) >= 4 and first not in out


# ------------------------------------------------------------------------------ served for real

@pytest.fixture
def served(tiny_cpu_server):
    return tiny_cpu_server


def words(server, path: str = "generate", **body) -> tuple[int, list[str]]:
    """POST to the ensemble; the status and the words of the completion (every streamed piece joined)."""
    response = requests.post(f"{server.http_url}/v2/models/ensemble/{path}",
                             json={"text_input": " w5 w6 w7 w8", "exclude_input_in_output": True, **body}, timeout=120)
    if response.status_code != 200:
        return response.status_code, [response.text]
    if path == "generate":
        return 200, response.json()["text_output"].split()
    events = [json.loads(line[5:]) for line in response.text.splitlines() if line.startswith("data:")]
    return 200, "".join(e["text_output"] for e in events).split()


@pytest.mark.slow
def test_served_model_answers_min_tokens_instead_of_refusing_it(served):
    status, first = words(served, max_tokens=1)
    assert status == 200 and len(first) == 1
    end_id = int(first[0].removeprefix("w"))
    assert words(served, max_tokens=8, end_id=end_id) == (200, [])
    status, out = words(served, max_tokens=12, end_id=end_id, min_tokens=4)
    assert status == 200 and len(out) >= 4 and first[0] not in out
    status, streamed = words(served, "generate_stream", max_tokens=12, end_id=end_id, min_tokens=4, stream=True)
    assert status == 200 and streamed == out


@pytest.mark.slow
def test_served_model_refuses_a_negative_min_tokens(served):
    status, body = words(served, max_tokens=4, min_tokens=-1)
    assert status == 400 and "min_tokens must be >= 0" in body[0]
