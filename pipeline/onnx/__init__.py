"""The decoder as ONNX (`trtpipe export-onnx`) and ONNX Runtime serving it; the export's file names."""

MODEL_FILE, DATA_FILE, CONFIG_FILE = "model.onnx", "model.onnx.data", "genai_config.json"
#: the graph's optional input that limits logits to the last N positions (0, its default: all), as transformers'
#: `logits_to_keep`: a prefill that needs only its last token's logits skips the lm_head over the rest of the prompt
LOGITS_TO_KEEP = "logits_to_keep"
#: the graph's optional prompt group (default: none): one more sequence's prompt, computed in the same step as the
#: rows of `input_ids` (through the same linears), with its own causal attention and no cache; its last token's
#: logits and its K/V come out as `prompt_logits` and `prompt_present.N.key/value`
PROMPT_IDS, PROMPT_LOGITS = "prompt_ids", "prompt_logits"


def prompt_present(present: str) -> str:
    """The prompt group's output for a `present.N.key/value` name (graph and runner both name it through this)."""
    return "prompt_" + present


def in_place_fits(arch) -> bool:
    """Whether a model's attention (a `ModelArch`) can be GroupQueryAttention's with the KV cache in place: ONNX
    Runtime's CPU kernel takes head sizes that are multiples of 8 (contrib_ops/cpu/bert/group_query_attention_helper.h),
    and sliding windows are left to the concat cache (docs/onnx.md)."""
    return arch.head_size % 8 == 0 and not arch.sliding_window
