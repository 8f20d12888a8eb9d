"""NVIDIA's tensor contract for the five inflight_batcher_llm models, as trtpipe declares it.

Every input and output of NVIDIA's `ensemble`, `preprocessing`, `tensorrt_llm`, `postprocessing` and
`tensorrt_llm_bls` configs at TensorRT-LLM 1.2.0rc8 (`triton_backend/all_models/inflight_batcher_llm/*/
config.pbtxt`, the line the 1.2.1 engine backend ships; docs/upstream-facts.md §B3 has the same tables and the
commits read), with NVIDIA's names, data types, dims, `optional`, `reshape: { shape: [ ] }` and
`allow_ragged_batch`, and the ensemble's step maps. Declaring all of them is what lets NVIDIA's own
preprocessing, postprocessing and BLS model.py run unchanged on trtpipe's configs (Triton refuses a request for
a tensor a config does not declare) and keeps every feature a client of NVIDIA's deployment uses. What a model
cannot honour it refuses per request (the cpu model, trtpipe's preprocessing), never by leaving it undeclared.

Each table line: `name TYPE dims [opt] [scalar] [ragged]`; `scalar` is the reshape to a scalar. Two data types
are NVIDIA's fill-template placeholders: `LOGITS` (`${logits_datatype}`, resolved when the config is built)
and the `FP16` of `prompt_embedding_table` / `encoder_input_features` (`${prompt_embedding_table_data_type}`,
`${encoder_input_features_data_type}`: FP16, as NVIDIA's ensemble and BLS declare the table). NVIDIA's ensemble
lists `kv_cache_alloc_total_blocks` twice; it is declared once.
"""

from __future__ import annotations

from .tritonconfig import LOGITS, Step, TensorSpec

FLAGS = {"opt": "optional", "scalar": "scalar", "ragged": "ragged"}


def tensors(table: str) -> tuple[TensorSpec, ...]:
    """The TensorSpecs of a table (one `name TYPE dims [flags]` per line)."""
    specs = []
    for line in table.strip().splitlines():
        name, dtype, dims, *flags = line.split()
        specs.append(TensorSpec(name, dtype if dtype == LOGITS else f"TYPE_{dtype}",
                                tuple(int(d) for d in dims.split(",")), **{FLAGS[f]: True for f in flags}))
    return tuple(specs)


def mapping(pairs: str) -> dict[str, str]:
    """`model_tensor:ensemble_tensor` pairs (a lone name maps to itself)."""
    found = {}
    for item in pairs.split():
        name, _, target = item.partition(":")
        found[name] = target or name
    return found


def step(model_name: str, input_map: str, output_map: str) -> Step:
    return Step(model_name, mapping(input_map), mapping(output_map))


ENSEMBLE_INPUTS = tensors("""
text_input                 STRING 1
decoder_text_input         STRING 1 opt
max_tokens                 INT32 1
num_return_sequences       INT32 1 opt
bad_words                  STRING -1 opt
stop_words                 STRING -1 opt
exclude_input_in_output    BOOL 1 opt
end_id                     INT32 1 opt
pad_id                     INT32 1 opt
top_k                      INT32 1 opt
top_p                      FP32 1 opt
temperature                FP32 1 opt
length_penalty             FP32 1 opt
repetition_penalty         FP32 1 opt
min_tokens                 INT32 1 opt
presence_penalty           FP32 1 opt
frequency_penalty          FP32 1 opt
seed                       UINT64 1 opt
return_log_probs           BOOL 1 opt
return_context_logits      BOOL 1 opt
return_generation_logits   BOOL 1 opt
return_perf_metrics        BOOL 1 opt
return_num_input_tokens    BOOL 1 opt
return_num_output_tokens   BOOL 1 opt
beam_width                 INT32 1 opt
stream                     BOOL 1 opt
prompt_embedding_table     FP16 -1,-1 opt
prompt_table_extra_id      UINT64 1 opt
prompt_vocab_size          INT32 1 opt
embedding_bias_words       STRING -1 opt
embedding_bias_weights     FP32 -1 opt
lora_task_id               UINT64 1 opt
lora_weights               FP16 -1,-1 opt ragged
lora_config                INT32 -1,3 opt ragged
guided_decoding_guide_type STRING 1 opt ragged
guided_decoding_guide      STRING 1 opt ragged
""")
ENSEMBLE_OUTPUTS = tensors("""
text_output                 STRING -1
cum_log_probs               FP32 -1
output_log_probs            FP32 -1,-1
context_logits              LOGITS -1,-1
generation_logits           LOGITS -1,-1,-1
batch_index                 INT32 1
sequence_index              INT32 1
kv_cache_alloc_new_blocks   INT32 1
kv_cache_reused_blocks      INT32 1
kv_cache_alloc_total_blocks INT32 1
arrival_time_ns             INT64 1
first_scheduled_time_ns     INT64 1
first_token_time_ns         INT64 1
last_token_time_ns          INT64 1
acceptance_rate             FP32 1
total_accepted_draft_tokens INT32 1
total_draft_tokens          INT32 1
num_input_tokens            INT32 1
num_output_tokens           INT32 1
""")

PREPROCESSING_INPUTS = tensors("""
QUERY                  STRING 1
DECODER_QUERY          STRING 1 opt
IMAGE_BYTES            UINT8 -1,-1,-1,-1 opt
IMAGE_URL              STRING 1 opt
IMAGES                 STRING -1 opt
VIDEO_BYTES            UINT8 -1,-1,-1,-1 opt
REQUEST_OUTPUT_LEN     INT32 1
BAD_WORDS_DICT         STRING -1 opt
STOP_WORDS_DICT        STRING -1 opt
EMBEDDING_BIAS_WORDS   STRING -1 opt
EMBEDDING_BIAS_WEIGHTS FP32 -1 opt
END_ID                 INT32 1 opt
PAD_ID                 INT32 1 opt
PROMPT_TABLE_EXTRA_ID  UINT64 1 opt
""")
PREPROCESSING_OUTPUTS = tensors("""
INPUT_ID                   INT32 -1
REQUEST_INPUT_LEN          INT32 1
DECODER_INPUT_ID           INT32 -1
REQUEST_DECODER_INPUT_LEN  INT32 1
BAD_WORDS_IDS              INT32 2,-1
STOP_WORDS_IDS             INT32 2,-1
EMBEDDING_BIAS             FP32 -1
REQUEST_OUTPUT_LEN         INT32 -1
OUT_END_ID                 INT32 1
OUT_PAD_ID                 INT32 1
OUT_PROMPT_TABLE_EXTRA_IDS UINT64 -1
PIXEL_VALUES               FP16 -1,-1,-1,-1
ASPECT_RATIO_IDS           INT64 -1
ASPECT_RATIO_MASK          INT64 -1,-1
CROSS_ATTENTION_MASK       INT64 -1,-1,-1
IMAGE_SIZES                INT64 -1,2
IS_VIDEO_INPUT             BOOL 1
ATTENTION_MASK             INT64 -1
IMAGE_GRID_THW             INT64 3
VISION_INPUT_ID            INT32 -1
""")

TENSORRT_LLM_INPUTS = tensors("""
input_ids                          INT32 -1 opt ragged
encoder_input_features             FP16 -1,-1 opt ragged
encoder_output_lengths             INT32 1 opt scalar
input_lengths                      INT32 1 scalar
request_output_len                 INT32 1 scalar
num_return_sequences               INT32 1 opt scalar
draft_input_ids                    INT32 -1 opt ragged
decoder_input_ids                  INT32 -1 opt ragged
decoder_input_lengths              INT32 1 opt scalar
draft_logits                       LOGITS -1,-1 opt ragged
draft_acceptance_threshold         FP32 1 opt scalar
end_id                             INT32 1 opt scalar
pad_id                             INT32 1 opt scalar
stop_words_list                    INT32 2,-1 opt ragged
bad_words_list                     INT32 2,-1 opt ragged
embedding_bias                     FP32 -1 opt ragged
beam_width                         INT32 1 opt scalar
temperature                        FP32 1 opt scalar
runtime_top_k                      INT32 1 opt scalar
runtime_top_p                      FP32 1 opt scalar
runtime_top_p_min                  FP32 1 opt scalar
runtime_top_p_decay                FP32 1 opt scalar
runtime_top_p_reset_ids            INT32 1 opt scalar
len_penalty                        FP32 1 opt scalar
early_stopping                     BOOL 1 opt scalar
repetition_penalty                 FP32 1 opt scalar
min_tokens                         INT32 1 opt scalar
beam_search_diversity_rate         FP32 1 opt scalar
presence_penalty                   FP32 1 opt scalar
frequency_penalty                  FP32 1 opt scalar
seed                               UINT64 1 opt scalar
return_log_probs                   BOOL 1 opt scalar
return_context_logits              BOOL 1 opt scalar
return_generation_logits           BOOL 1 opt scalar
return_perf_metrics                BOOL 1 opt scalar
return_num_input_tokens            BOOL 1 opt scalar
return_num_output_tokens           BOOL 1 opt scalar
exclude_input_in_output            BOOL 1 opt scalar
stop                               BOOL 1 opt scalar
streaming                          BOOL 1 opt scalar
prompt_embedding_table             FP16 -1,-1 opt ragged
prompt_table_extra_ids             UINT64 -1 opt ragged
prompt_vocab_size                  INT32 1 opt scalar
cross_attention_mask               BOOL -1,-1 opt ragged
mrope_rotary_cos_sin               FP32 -1 opt
mrope_position_deltas              INT64 1 opt
lora_task_id                       UINT64 1 opt scalar
lora_weights                       FP16 -1,-1 opt ragged
lora_config                        INT32 -1,3 opt ragged
context_phase_params               UINT8 -1 opt ragged
skip_cross_attn_blocks             BOOL 1 opt ragged
retention_token_range_starts       INT32 -1 opt ragged
retention_token_range_ends         INT32 -1 opt ragged
retention_token_range_priorities   INT32 -1 opt ragged
retention_token_range_durations_ms INT32 -1 opt ragged
retention_decode_priority          INT32 1 opt ragged
retention_decode_duration_ms       INT32 1 opt ragged
guided_decoding_guide_type         STRING 1 opt ragged
guided_decoding_guide              STRING 1 opt ragged
lookahead_window_size              INT32 1 opt ragged
lookahead_ngram_size               INT32 1 opt ragged
lookahead_verification_set_size    INT32 1 opt ragged
""")
TENSORRT_LLM_OUTPUTS = tensors("""
output_ids                  INT32 -1,-1
sequence_length             INT32 -1
cum_log_probs               FP32 -1
output_log_probs            FP32 -1,-1
context_logits              LOGITS -1,-1
generation_logits           LOGITS -1,-1,-1
batch_index                 INT32 1
sequence_index              INT32 1
context_phase_params        UINT8 -1
kv_cache_alloc_new_blocks   INT32 1
kv_cache_reused_blocks      INT32 1
kv_cache_alloc_total_blocks INT32 1
arrival_time_ns             INT64 1
first_scheduled_time_ns     INT64 1
first_token_time_ns         INT64 1
last_token_time_ns          INT64 1
acceptance_rate             FP32 1
total_accepted_draft_tokens INT32 1
total_draft_tokens          INT32 1
num_input_tokens            INT32 1
num_output_tokens           INT32 1
""")

POSTPROCESSING_INPUTS = tensors("""
TOKENS_BATCH    INT32 -1,-1
SEQUENCE_LENGTH INT32 -1
""")
POSTPROCESSING_OUTPUTS = tensors("""
OUTPUT STRING -1
""")

TENSORRT_LLM_BLS_INPUTS = tensors("""
text_input                 STRING 1
decoder_text_input         STRING 1 opt
image_input                FP16 -1,3,-1,-1 opt
image_bytes_input          UINT8 -1,-1,-1,-1 opt
image_url_input            STRING 1 opt
video_bytes_input          UINT8 -1,-1,-1,-1 opt
max_tokens                 INT32 1
bad_words                  STRING -1 opt
stop_words                 STRING -1 opt
exclude_input_in_output    BOOL 1 opt
end_id                     INT32 1 opt
pad_id                     INT32 1 opt
top_k                      INT32 1 opt
top_p                      FP32 1 opt
temperature                FP32 1 opt
length_penalty             FP32 1 opt
repetition_penalty         FP32 1 opt
min_tokens                 INT32 1 opt
presence_penalty           FP32 1 opt
frequency_penalty          FP32 1 opt
seed                       UINT64 1 opt
return_log_probs           BOOL 1 opt scalar
return_context_logits      BOOL 1 opt scalar
return_generation_logits   BOOL 1 opt scalar
num_return_sequences       INT32 1 opt scalar
beam_width                 INT32 1 opt
stream                     BOOL 1 opt
prompt_embedding_table     FP16 -1,-1 opt
prompt_vocab_size          INT32 1 opt
prompt_table_extra_id      UINT64 1 opt
embedding_bias_words       STRING -1 opt
embedding_bias_weights     FP32 -1 opt
num_draft_tokens           INT32 1 opt
use_draft_logits           BOOL 1 opt scalar
lora_task_id               UINT64 1 opt scalar
lora_weights               FP16 -1,-1 opt ragged
lora_config                INT32 -1,3 opt ragged
return_perf_metrics        BOOL 1 opt scalar
return_num_input_tokens    BOOL 1 opt scalar
return_num_output_tokens   BOOL 1 opt scalar
guided_decoding_guide_type STRING 1 opt
guided_decoding_guide      STRING 1 opt
""")
#: NVIDIA's BLS declares exactly the ensemble's outputs (the same 19 tensors, in the same order)
TENSORRT_LLM_BLS_OUTPUTS = ENSEMBLE_OUTPUTS

ENSEMBLE_STEPS = (
    step("preprocessing", """
    QUERY:text_input DECODER_QUERY:decoder_text_input REQUEST_OUTPUT_LEN:max_tokens BAD_WORDS_DICT:bad_words
    STOP_WORDS_DICT:stop_words EMBEDDING_BIAS_WORDS:embedding_bias_words
    EMBEDDING_BIAS_WEIGHTS:embedding_bias_weights END_ID:end_id PAD_ID:pad_id
    PROMPT_TABLE_EXTRA_ID:prompt_table_extra_id
""", """
    INPUT_ID:_INPUT_ID REQUEST_INPUT_LEN:_REQUEST_INPUT_LEN DECODER_INPUT_ID:_DECODER_INPUT_ID
    REQUEST_DECODER_INPUT_LEN:_REQUEST_DECODER_INPUT_LEN BAD_WORDS_IDS:_BAD_WORDS_IDS
    STOP_WORDS_IDS:_STOP_WORDS_IDS EMBEDDING_BIAS:_EMBEDDING_BIAS REQUEST_OUTPUT_LEN:_REQUEST_OUTPUT_LEN
    OUT_END_ID:_PREPROCESSOR_END_ID OUT_PAD_ID:_PREPROCESSOR_PAD_ID
    OUT_PROMPT_TABLE_EXTRA_IDS:_OUT_PROMPT_TABLE_EXTRA_IDS
"""),
    step("tensorrt_llm", """
    input_ids:_INPUT_ID input_lengths:_REQUEST_INPUT_LEN request_output_len:_REQUEST_OUTPUT_LEN
    num_return_sequences decoder_input_ids:_DECODER_INPUT_ID decoder_input_lengths:_REQUEST_DECODER_INPUT_LEN
    end_id:_PREPROCESSOR_END_ID pad_id:_PREPROCESSOR_PAD_ID stop_words_list:_STOP_WORDS_IDS
    bad_words_list:_BAD_WORDS_IDS embedding_bias:_EMBEDDING_BIAS beam_width temperature runtime_top_k:top_k
    runtime_top_p:top_p len_penalty:length_penalty repetition_penalty min_tokens presence_penalty
    frequency_penalty seed return_log_probs return_context_logits return_generation_logits return_perf_metrics
    return_num_input_tokens return_num_output_tokens exclude_input_in_output streaming:stream
    prompt_embedding_table prompt_table_extra_ids:_OUT_PROMPT_TABLE_EXTRA_IDS prompt_vocab_size lora_task_id
    lora_weights lora_config guided_decoding_guide_type guided_decoding_guide
""", """
    output_ids:_TOKENS_BATCH sequence_length:_SEQUENCE_LENGTH cum_log_probs output_log_probs context_logits
    generation_logits batch_index sequence_index kv_cache_alloc_new_blocks kv_cache_reused_blocks
    kv_cache_alloc_total_blocks arrival_time_ns first_scheduled_time_ns first_token_time_ns last_token_time_ns
    acceptance_rate total_accepted_draft_tokens total_draft_tokens num_input_tokens num_output_tokens
"""),
    step("postprocessing", """
    TOKENS_BATCH:_TOKENS_BATCH SEQUENCE_LENGTH:_SEQUENCE_LENGTH
""", """
    OUTPUT:text_output
"""),
)

#: model name -> (inputs, outputs), for the checks of any repository with NVIDIA's layout
MODELS = {
    "ensemble": (ENSEMBLE_INPUTS, ENSEMBLE_OUTPUTS),
    "preprocessing": (PREPROCESSING_INPUTS, PREPROCESSING_OUTPUTS),
    "tensorrt_llm": (TENSORRT_LLM_INPUTS, TENSORRT_LLM_OUTPUTS),
    "postprocessing": (POSTPROCESSING_INPUTS, POSTPROCESSING_OUTPUTS),
    "tensorrt_llm_bls": (TENSORRT_LLM_BLS_INPUTS, TENSORRT_LLM_BLS_OUTPUTS),
}


def declared_differently(spec: TensorSpec, tensor, dtype_name, is_input: bool) -> str | None:
    """How a config's tensor (a ModelInput/ModelOutput message) differs from NVIDIA's, or None. A `LOGITS` tensor
    may have any floating type (`${logits_datatype}`)."""
    dtype = dtype_name(tensor.data_type)
    if spec.dtype == LOGITS and dtype not in ("TYPE_FP32", "TYPE_FP16", "TYPE_BF16") or \
            spec.dtype != LOGITS and dtype != spec.dtype:
        return f"data type {dtype}, NVIDIA's is {'a float type' if spec.dtype == LOGITS else spec.dtype}"
    if tuple(tensor.dims) != spec.dims:
        return f"dims {list(tensor.dims)}, NVIDIA's are {list(spec.dims)}"
    if is_input and tensor.HasField("reshape") != spec.scalar:
        return "reshape " + ("missing" if spec.scalar else "not in NVIDIA's") + " (a scalar per request)"
    if is_input and tensor.optional != spec.optional:
        return "optional " + str(tensor.optional).lower() + f", NVIDIA's is {str(spec.optional).lower()}"
    return None
