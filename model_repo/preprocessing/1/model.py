"""preprocessing: text -> token ids, with the tensor contract of NVIDIA's inflight_batcher_llm preprocessing.

Inputs QUERY, REQUEST_OUTPUT_LEN and optional BAD_WORDS_DICT, STOP_WORDS_DICT, EMBEDDING_BIAS_WORDS,
EMBEDDING_BIAS_WEIGHTS, END_ID, PAD_ID; outputs INPUT_ID (right-padded with the end id), REQUEST_INPUT_LEN,
BAD_WORDS_IDS / STOP_WORDS_IDS ([2, N]: flat ids, then cumulative offsets padded with -1),
EMBEDDING_BIAS, REQUEST_OUTPUT_LEN, OUT_END_ID, OUT_PAD_ID, and, as NVIDIA's preprocessing does for a
decoder-only model, DECODER_INPUT_ID = [pad id] with REQUEST_DECODER_INPUT_LEN = 1 (the tensorrtllm backend
reads them only for encoder-decoder engines). The inputs of NVIDIA's contract this model does not implement
(images, video, a decoder query, prompt-table ids: `REFUSED`) are refused by name when a request sends them.
The tokenizer directory is resolved relative
to the repository's root, so the repository can move. The tensor names and `parameter` are
pipeline/triton_names.py's, which deploy copies beside this file.
"""

import json
import sys
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils
from transformers import AutoTokenizer

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # the copied pipeline/triton_names.py wins over any installed trtpipe
from pipeline.triton_names import (  # noqa: E402
    PRE_BAD_WORDS_DICT, PRE_BAD_WORDS_IDS, PRE_DECODER_INPUT_ID, PRE_EMBEDDING_BIAS, PRE_EMBEDDING_BIAS_WEIGHTS,
    PRE_EMBEDDING_BIAS_WORDS, PRE_END_ID, PRE_INPUT_ID, PRE_OUT_END_ID, PRE_OUT_PAD_ID, PRE_PAD_ID, PRE_QUERY,
    PRE_REQUEST_DECODER_INPUT_LEN, PRE_REQUEST_INPUT_LEN, PRE_REQUEST_OUTPUT_LEN, PRE_STOP_WORDS_DICT,
    PRE_STOP_WORDS_IDS, parameter,
)
from pipeline.spans import span  # noqa: E402

#: relative paths in the config are relative to the repository's root, as NVIDIA's models read them when
#: tritonserver runs there (trtpipe.deploy.tokenizer_parameter), whatever the working directory
REPOSITORY = Path(__file__).resolve().parents[2]
TRUE = ("true", "1", "t", "y", "yes")
#: NVIDIA's preprocessing inputs this model does not implement, with what serves them instead.
REFUSED = {name: "multimodal input needs NVIDIA's preprocessing with a multimodal model (multimodal_model_path)"
           for name in ("IMAGE_BYTES", "IMAGE_URL", "IMAGES", "VIDEO_BYTES")}
REFUSED["DECODER_QUERY"] = "decoder_text_input is for encoder-decoder models; this deployment is decoder-only"
REFUSED["PROMPT_TABLE_EXTRA_ID"] = ("prompt_table_extra_id (p-tuning) is not supported by trtpipe's preprocessing; "
                                   "deploy with --python-models nvidia on a GPU")


def load_tokenizer(config: dict):
    directory = Path(parameter(config, "tokenizer_dir", "preprocessing/1/tokenizer"))
    tokenizer = AutoTokenizer.from_pretrained(directory if directory.is_absolute() else REPOSITORY / directory,
                                              legacy=False, padding_side="left")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def optional(request, name: str):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return None if tensor is None else tensor.as_numpy()


def text(value) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.tokenizer = load_tokenizer(config)
        self.add_special_tokens = parameter(config, "add_special_tokens", "true").lower() in TRUE
        self.end_id = self.tokenizer.eos_token_id
        self.pad_id = self.tokenizer.pad_token_id

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                responses.append(pb_utils.InferenceResponse(output_tensors=self.preprocess(request)))
            except ValueError as exc:
                responses.append(pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(str(exc))))
        return responses

    def preprocess(self, request) -> list:
        for name, reason in REFUSED.items():
            if pb_utils.get_input_tensor_by_name(request, name) is not None:
                raise ValueError(f"{name}: {reason}")
        queries = pb_utils.get_input_tensor_by_name(request, PRE_QUERY).as_numpy()
        batch = queries.shape[0]
        output_len = pb_utils.get_input_tensor_by_name(request, PRE_REQUEST_OUTPUT_LEN).as_numpy()
        end_id = optional(request, PRE_END_ID)
        pad_id = optional(request, PRE_PAD_ID)
        end_id = np.full((batch, 1), self.end_id, np.int32) if end_id is None else end_id.astype(np.int32)
        pad_id = np.full((batch, 1), self.pad_id, np.int32) if pad_id is None else pad_id.astype(np.int32)
        with span("tokenize", request=request.request_id(), rows=batch):
            ids = [self.encode(text(q.reshape(-1)[0])) for q in queries]
        longest = max(len(i) for i in ids)
        input_ids = np.array([i + [int(end_id[r, 0])] * (longest - len(i)) for r, i in enumerate(ids)], np.int32)
        return [
            pb_utils.Tensor(PRE_INPUT_ID, input_ids),
            pb_utils.Tensor(PRE_REQUEST_INPUT_LEN, np.array([[len(i)] for i in ids], np.int32)),
            pb_utils.Tensor(PRE_DECODER_INPUT_ID, pad_id.reshape(batch, 1).copy()),
            pb_utils.Tensor(PRE_REQUEST_DECODER_INPUT_LEN, np.ones((batch, 1), np.int32)),
            pb_utils.Tensor(PRE_BAD_WORDS_IDS, self.word_lists(optional(request, PRE_BAD_WORDS_DICT), batch)),
            pb_utils.Tensor(PRE_STOP_WORDS_IDS, self.word_lists(optional(request, PRE_STOP_WORDS_DICT), batch)),
            pb_utils.Tensor(PRE_EMBEDDING_BIAS, self.embedding_bias(optional(request, PRE_EMBEDDING_BIAS_WORDS),
                                                                    optional(request, PRE_EMBEDDING_BIAS_WEIGHTS),
                                                                    batch)),
            pb_utils.Tensor(PRE_REQUEST_OUTPUT_LEN, output_len.astype(np.int32)),
            pb_utils.Tensor(PRE_OUT_END_ID, end_id),
            pb_utils.Tensor(PRE_OUT_PAD_ID, pad_id),
        ]

    def encode(self, query: str) -> list:
        # As NVIDIA's preprocessing: the query with the tokenizer's special tokens, so "" is the BOS alone where the
        # tokenizer adds one (and is answered); only a prompt of no tokens at all is refused.
        ids = self.tokenizer.encode(query, add_special_tokens=self.add_special_tokens)
        if not ids:
            raise ValueError("text_input is empty: it tokenizes to no tokens")
        return ids

    def word_lists(self, words, batch: int) -> np.ndarray:
        """[batch, 2, N]: each row's words tokenized and concatenated, then the cumulative end offsets."""
        if words is None:
            return np.zeros((batch, 2, 0), np.int32)
        flat, offsets = [], []
        for row in words:
            sequences = [self.tokenizer.encode(text(w), add_special_tokens=False) for w in row.reshape(-1)]
            sequences = [s for s in sequences if s]
            flat.append([t for s in sequences for t in s])
            offsets.append(list(np.cumsum([len(s) for s in sequences])))
        width = max(1, max(len(f) for f in flat))
        out = np.zeros((batch, 2, width), np.int32)
        out[:, 1, :] = -1
        for r, (ids, ends) in enumerate(zip(flat, offsets)):
            out[r, 0, :len(ids)] = ids
            out[r, 1, :len(ends)] = ends
        return out

    def embedding_bias(self, words, weights, batch: int) -> np.ndarray:
        if words is None or weights is None:
            return np.zeros((batch, 0), np.float32)
        bias = np.zeros((batch, len(self.tokenizer)), np.float32)
        for r in range(batch):
            row_words, row_weights = words[r].reshape(-1), weights[r].reshape(-1)
            if len(row_words) != len(row_weights):
                raise ValueError(f"embedding_bias_words has {len(row_words)} entries but embedding_bias_weights "
                                 f"has {len(row_weights)}")
            for word, weight in zip(row_words, row_weights):
                for token in self.tokenizer.encode(text(word), add_special_tokens=False):
                    bias[r, token] += weight
        return bias
