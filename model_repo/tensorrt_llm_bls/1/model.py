"""tensorrt_llm_bls: the ensemble's pipeline as one Python (BLS) model, with the ensemble's tensor contract.

It calls preprocessing, the LLM model (parameter `tensorrt_llm_model_name`) and postprocessing with
the same tensor maps as the ensemble (`wiring.json`, written by `trtpipe deploy` from the ensemble's
steps). In decoupled mode each request is answered from its own thread, so one instance serves many
requests at once, and streaming requests get one response per LLM response; with
`accumulate_tokens` true each streamed text_output is the whole text so far instead of the new piece.
The tensor and model names and `parameter` are pipeline/triton_names.py's, which deploy copies beside this file.
"""

import json
import sys
import threading
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # the copied pipeline/triton_names.py wins over any installed trtpipe
from pipeline.triton_names import (  # noqa: E402
    OUTPUT_IDS, POSTPROCESSING, PREPROCESSING, STEP_SEQUENCE_LENGTH, STEP_TOKENS_BATCH, STREAM, TENSORRT_LLM,
    TENSORRT_LLM_MODEL_NAME, parameter,
)

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
#: BLS inputs of NVIDIA's contract that only NVIDIA's BLS implements (multimodal encoders, a draft model),
#: refused by name instead of being dropped.
REFUSED = {**{name: "multimodal input needs NVIDIA's BLS with a multimodal encoder (multimodal_encoders_name)"
              for name in ("image_input", "image_bytes_input", "image_url_input", "video_bytes_input")},
           **{name: "speculative decoding needs NVIDIA's BLS with a draft model (tensorrt_llm_draft_model_name)"
              for name in ("num_draft_tokens", "use_draft_logits")}}


def call(model_name: str, tensors: dict, outputs: list, decoupled: bool = False):
    request = pb_utils.InferenceRequest(model_name=model_name, requested_output_names=outputs,
                                        inputs=[pb_utils.Tensor(k, v) for k, v in tensors.items()])
    return request.exec(decoupled=decoupled)


def outputs_of(response, names) -> dict:
    if response.has_error():
        raise pb_utils.TritonModelException(response.error().message())
    found = {}
    for name in names:
        tensor = pb_utils.get_output_tensor_by_name(response, name)
        if tensor is not None:
            found[name] = tensor.as_numpy()
    return found


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(config)
        self.llm = parameter(config, TENSORRT_LLM_MODEL_NAME, TENSORRT_LLM)
        self.accumulate = parameter(config, "accumulate_tokens", "false").lower() == "true"
        self.wiring = json.loads((HERE / "wiring.json").read_text())
        self.output_names = [o["name"] for o in config["output"]]

    def execute(self, requests):
        """Decoupled: every request runs in its own thread (execute returns at once); else in turn."""
        if self.decoupled:
            for request in requests:
                threading.Thread(target=self.answer, args=(request,), daemon=True).start()
            return None
        return [self.single_response(request) for request in requests]

    def answer(self, request) -> None:
        sender = request.get_response_sender()
        try:
            for response in self.generate(request):
                sender.send(response)
            sender.send(flags=FINAL)
        except Exception as exc:  # every failure goes back to the client as the request's error
            sender.send(pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(str(exc))),
                        flags=FINAL)

    def single_response(self, request):
        try:
            return next(iter(self.generate(request)))
        except Exception as exc:  # every failure goes back to the client as the request's error
            return pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(str(exc)))

    def generate(self, request):
        """Yield the responses for one request: preprocessing -> LLM (streamed or not) -> postprocessing."""
        client = {t.name(): t.as_numpy() for t in request.inputs()}
        for name in sorted(set(client) & set(REFUSED)):
            raise pb_utils.TritonModelException(f"{name}: {REFUSED[name]}")
        stream = bool(client[STREAM].reshape(-1)[0]) if STREAM in client else False
        if stream and not self.decoupled:
            raise pb_utils.TritonModelException("Streaming is only supported if model is deployed using "
                                                "decoupled mode.")
        tensors = dict(client)
        pre = self.wiring[PREPROCESSING]
        produced = outputs_of(call(PREPROCESSING, self.inputs_for(pre, tensors), list(pre["output_map"])),
                              pre["output_map"])
        tensors.update({pre["output_map"][k]: v for k, v in produced.items()})
        llm = self.wiring[TENSORRT_LLM]
        llm_responses = call(self.llm, self.inputs_for(llm, tensors), list(llm["output_map"]), self.decoupled)
        accumulated = None
        for llm_response in (llm_responses if self.decoupled else [llm_responses]):
            produced = outputs_of(llm_response, llm["output_map"])
            if OUTPUT_IDS not in produced:  # an empty final response
                continue
            step = {llm["output_map"][k]: v for k, v in produced.items()}
            if self.accumulate and stream:
                accumulated = self.accumulate_ids(accumulated, step)
            yield self.respond(step)

    @staticmethod
    def inputs_for(step: dict, tensors: dict) -> dict:
        """The step's inputs. An input this model's config reshapes to a scalar arrives as [batch]; the called
        model's config declares it [batch, 1] (its own reshape applies after), so it goes on as [batch, 1]."""
        return {key: tensors[value].reshape(-1, 1) if tensors[value].ndim == 1 else tensors[value]
                for key, value in step["input_map"].items() if value in tensors}

    def accumulate_ids(self, accumulated, step: dict):
        """Replace the step's new tokens by all tokens so far (one beam per row while streaming)."""
        tokens, lengths = step[STEP_TOKENS_BATCH], step[STEP_SEQUENCE_LENGTH]
        new = [row[0, :row_len[0]] for row, row_len in zip(tokens, lengths)]
        accumulated = new if accumulated is None else [np.concatenate([a, n]) for a, n in zip(accumulated, new)]
        width = max(len(a) for a in accumulated)
        step[STEP_TOKENS_BATCH] = np.array([[np.pad(a, (0, width - len(a)))] for a in accumulated], np.int32)
        step[STEP_SEQUENCE_LENGTH] = np.array([[len(a)] for a in accumulated], np.int32)
        return accumulated

    def respond(self, step: dict):
        post = self.wiring[POSTPROCESSING]
        produced = outputs_of(call(POSTPROCESSING, self.inputs_for(post, step), list(post["output_map"])),
                              post["output_map"])
        step.update({post["output_map"][k]: v for k, v in produced.items()})
        return pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(name, step[name])
                                                          for name in self.output_names if name in step])
