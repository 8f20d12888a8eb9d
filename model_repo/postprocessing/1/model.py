"""postprocessing: token ids -> text, with the tensor contract of NVIDIA's inflight_batcher_llm postprocessing.

TOKENS_BATCH [batch, beams, tokens] and SEQUENCE_LENGTH [batch, beams] in, OUTPUT [batch, beams] out
(UTF-8 strings). The tokenizer directory is resolved relative to the repository's root, so the repository can
move. The tensor names and `parameter` are pipeline/triton_names.py's, which deploy copies beside this file.
"""

import json
import sys
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils
from transformers import AutoTokenizer

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # the copied pipeline/triton_names.py wins over any installed trtpipe
from pipeline.spans import span  # noqa: E402
from pipeline.triton_names import POST_OUTPUT, POST_SEQUENCE_LENGTH, POST_TOKENS_BATCH, parameter  # noqa: E402

#: relative paths in the config are relative to the repository's root, as NVIDIA's models read them when
#: tritonserver runs there (trtpipe.deploy.tokenizer_parameter), whatever the working directory
REPOSITORY = Path(__file__).resolve().parents[2]
TRUE = ("true", "1", "t", "y", "yes")


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        directory = Path(parameter(config, "tokenizer_dir", "postprocessing/1/tokenizer"))
        self.tokenizer = AutoTokenizer.from_pretrained(directory if directory.is_absolute() else REPOSITORY / directory,
                                                       legacy=False, padding_side="left")
        self.skip_special_tokens = parameter(config, "skip_special_tokens", "true").lower() in TRUE

    def execute(self, requests):
        responses = []
        for request in requests:
            tokens = pb_utils.get_input_tensor_by_name(request, POST_TOKENS_BATCH).as_numpy()
            lengths = pb_utils.get_input_tensor_by_name(request, POST_SEQUENCE_LENGTH).as_numpy()
            if tokens.ndim == 2:  # [batch, tokens]: one beam
                tokens = tokens[:, None, :]
            lengths = lengths.reshape(tokens.shape[0], tokens.shape[1])
            with span("detokenize", request=request.request_id(), rows=tokens.shape[0]):
                texts = [[self.decode(beam[:length]) for beam, length in zip(row, row_lengths)]
                         for row, row_lengths in zip(tokens, lengths)]
            output = np.array([[t.encode("utf-8") for t in row] for row in texts], dtype=np.object_)
            responses.append(pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(POST_OUTPUT, output)]))
        return responses

    def decode(self, ids) -> str:
        return self.tokenizer.decode([int(t) for t in ids], skip_special_tokens=self.skip_special_tokens)
