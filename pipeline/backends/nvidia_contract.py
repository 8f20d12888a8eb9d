"""What NVIDIA's code does with each model-config parameter of an inflight_batcher_llm repository: the C++
tensorrtllm backend (the `tensorrt_llm` model) and NVIDIA's Python preprocessing/postprocessing/BLS models.

Read from tensorrtllm_backend @c2e65b8 `inflight_batcher_llm/src/` (MS = model_state.cc, MIS =
model_instance_state.cc) and TensorRT-LLM 1.2.0rc8 `triton_backend/all_models/inflight_batcher_llm/*/1/model.py`
(docs/upstream-facts.md §B2 has the table and the reading). Two facts decide everything:

- `ModelState::GetParameter<std::string>` throws "Cannot find parameter with name: X" for a key that is absent
  (MS:264); a read outside any try/catch then fails the instance, and the model with its ensemble, at load
  (MIS:46-54). Those keys are FATAL when missing.
- Inside a try/catch a numeric or bool `${name}` fails to parse and falls back like a missing key; three string
  keys compare their value with `"${name}"` explicitly and treat it (and "") as unset. `gpt_model_type` and the
  engine path have no such fallback: a placeholder there fails the load.

A value is followed to where NVIDIA's code finally uses it: a string the backend passes on as it is is judged by
what TensorRT-LLM then does with it (`lora_prefetch_dir`: skipped when the directory does not exist), and a key a
Python model reads only in one branch by that branch's condition (preprocessing's `gpt_model_path` and
`hf_model_path`: multimodal engines only).

`deploy` writes every key that is fatal when missing, `trtpipe check` judges a repository by this table
(never advising to remove a key the backend needs), and tests/test_nvidia_contract.py checks both against it.
"""

from __future__ import annotations

from dataclasses import dataclass

#: `missing` / `placeholder` values: the model does not load
FATAL = "fatal"
#: `placeholder` value: NVIDIA's code treats `${name}` (and for strings "") as not set and uses `missing`'s fallback
UNSET = "unset"
#: `placeholder` value: the string is used as it is (a path named `${...}`), nothing detects it
LITERAL = "literal"
#: `placeholder` value: the string is passed on as a path, and the code that finally uses it skips a path that does
#: not exist (`final_use` says where): the feature stays off
SKIPPED = "skipped"

#: `condition` values: preprocessing reads the key only for a multimodal engine (model.py:129), or only for the
#: multimodal model types that load a Hugging Face processor (model.py:154-164)
MULTIMODAL = "a multimodal engine (multimodal_model_path)"
PROCESSOR_MODEL_TYPES = ("mllama", "llava_onevision", "qwen2_vl", "pixtral")
MULTIMODAL_PROCESSOR = f"a multimodal engine of type {', '.join(PROCESSOR_MODEL_TYPES)}"


@dataclass(frozen=True)
class Parameter:
    name: str
    missing: str          # FATAL, or what the code does without the key (its fallback)
    placeholder: str      # FATAL | UNSET | LITERAL | SKIPPED: what an unfilled `${name}` does
    source: str           # file:line at the commits above
    condition: str = ""   # when the key is read at all, if not always
    final_use: str = ""   # SKIPPED: what the code the value is passed on to does with it, and where


def _table(*parameters: Parameter) -> dict[str, Parameter]:
    return {p.name: p for p in parameters}


#: The C++ tensorrtllm backend (the `tensorrt_llm` model of an engine repository).
TENSORRTLLM = _table(
    Parameter("gpt_model_type", FATAL, FATAL, "MIS:62-75"),
    Parameter("gpt_model_path", "'' (then fatal unless encoder_model_path is set: MIS:771)", FATAL,
              "MIS:746-755"),
    Parameter("encoder_model_path", "'' (a decoder-only model)", UNSET, "MIS:760-769"),
    Parameter("tokenizer_dir", FATAL, UNSET, "MIS:413, 417-422"),
    Parameter("xgrammar_tokenizer_info_path", FATAL, UNSET, "MIS:414, 424-428"),
    Parameter("guided_decoding_backend", FATAL, UNSET, "MIS:415, 424-428"),
    Parameter("max_beam_width", "1", UNSET, "MIS:459-462"),
    Parameter("iter_stats_max_iterations", "1000 (executor default)", UNSET, "MIS:470-473"),
    Parameter("request_stats_max_iterations", "0 (executor default)", UNSET, "MIS:482-485"),
    Parameter("enable_trt_overlap", "ignored (deprecated)", UNSET, "MIS:496-501"),
    Parameter("normalize_log_probs", "true", UNSET, "MIS:503-506"),
    Parameter("max_tokens_in_paged_kv_cache", "unset (the KV fraction alone sizes the cache)", UNSET, "MIS:86"),
    Parameter("kv_cache_free_gpu_mem_fraction", "unset (the executor's 0.9)", UNSET, "MIS:99"),
    Parameter("cross_kv_cache_fraction", "unset", UNSET, "MIS:112"),
    Parameter("kv_cache_host_memory_bytes", "unset (0: no host offload)", UNSET, "MIS:123"),
    Parameter("kv_cache_onboard_blocks", "true", UNSET, "MIS:130-133"),
    Parameter("max_attention_window_size", "unset (max_seq_len)", UNSET, "MIS:144"),
    Parameter("sink_token_length", "unset", UNSET, "MIS:157"),
    Parameter("enable_kv_cache_reuse", "true", UNSET, "MIS:167-170"),
    Parameter("enable_chunked_context", "false", UNSET, "MIS:518-521"),
    Parameter("batch_scheduler_policy", "guaranteed_no_evict", UNSET, "MIS:357-379"),
    Parameter("lora_cache_max_adapter_size", "64", UNSET, "MIS:296-305"),
    Parameter("lora_cache_optimal_adapter_size", "8", UNSET, "MIS:297-315"),
    Parameter("lora_cache_gpu_memory_fraction", "unset (0.05)", UNSET, "MIS:321-324"),
    Parameter("lora_cache_host_memory_bytes", "unset (1 GB)", UNSET, "MIS:330-333"),
    Parameter("lora_prefetch_dir", "unset", SKIPPED, "MIS:339-351",
              final_use="TensorRT-LLM skips a prefetch directory that does not exist: peftCacheManager.cpp:192-196"
                        "@9df6d722 (no LoRA adapter is prefetched)"),
    Parameter("num_nodes", "1", UNSET, "MIS:273-276"),
    Parameter("multi_block_mode", "true", UNSET, "MIS:191-194"),
    Parameter("enable_context_fmha_fp32_acc", "false", UNSET, "MIS:205"),
    Parameter("cuda_graph_mode", "false", UNSET, "MIS:216"),
    Parameter("cuda_graph_cache_size", "0", UNSET, "MIS:227"),
    Parameter("speculative_decoding_fast_logits", "false", UNSET, "MIS:390-403"),
    Parameter("decoding_mode", "unset (the executor chooses: top_k_top_p at beam width 1)", UNSET, "MIS:548-592"),
    Parameter("medusa_choices", "unset", UNSET, "MIS:598"),
    Parameter("eagle_choices", "unset", UNSET, "MIS:613"),
    Parameter("lookahead_window_size", FATAL, FATAL, "MIS:627-645", "decoding_mode lookahead"),
    Parameter("lookahead_ngram_size", FATAL, FATAL, "MIS:627-645", "decoding_mode lookahead"),
    Parameter("lookahead_verification_set_size", FATAL, FATAL, "MIS:627-645", "decoding_mode lookahead"),
    Parameter("gpu_weights_percent", "1.0", UNSET, "MIS:649-652"),
    Parameter("recv_poll_period_ms", "0 (busy polling)", UNSET, "MIS:682-689"),
    Parameter("exclude_input_in_output", "false", UNSET, "MIS:797-800"),
    Parameter("cancellation_check_period_ms", "100", UNSET, "MIS:809-812"),
    Parameter("stats_check_period_ms", "100", UNSET, "MIS:821-824"),
    Parameter("gpu_device_ids", "unset (the executor picks the devices)", UNSET, "MS:97-120"),
    Parameter("participant_ids", "unset", UNSET, "MS:124-147", "orchestrator mode"),
    Parameter("executor_worker_path", "/opt/tritonserver/backends/tensorrtllm/trtllmExecutorWorker", LITERAL,
              "MS:180-188", "orchestrator mode"),
)

#: NVIDIA's Python models, by model name: the keys their initialize() reads ([] raises KeyError: FATAL).
PYTHON_MODELS = {
    "preprocessing": _table(
        Parameter("tokenizer_dir", FATAL, FATAL, "preprocessing/1/model.py:63-64, 108-111"),
        Parameter("multimodal_model_path", FATAL, UNSET, "preprocessing/1/model.py:68-69, 86-87"),
        Parameter("add_special_tokens", "true", UNSET, "preprocessing/1/model.py:66-67, 89-106"),
        Parameter("max_num_images", "unset", UNSET, "preprocessing/1/model.py:70-85"),
        Parameter("gpt_model_path", FATAL, FATAL, "preprocessing/1/model.py:129, 145-149", MULTIMODAL),
        Parameter("hf_model_path", FATAL, FATAL, "preprocessing/1/model.py:129, 154-164", MULTIMODAL_PROCESSOR),
    ),
    "postprocessing": _table(
        Parameter("tokenizer_dir", FATAL, FATAL, "postprocessing/1/model.py:56-57, 81-84"),
        Parameter("skip_special_tokens", "true", UNSET, "postprocessing/1/model.py:59-79"),
    ),
    "tensorrt_llm_bls": _table(
        Parameter("accumulate_tokens", "false", UNSET, "tensorrt_llm_bls/1/model.py:37-39, 57-61"),
        Parameter("tensorrt_llm_model_name", "tensorrt_llm", UNSET, "tensorrt_llm_bls/1/model.py:68-71"),
        Parameter("tensorrt_llm_draft_model_name", "unset", UNSET, "tensorrt_llm_bls/1/model.py:73-74"),
        Parameter("multimodal_encoders_name", "unset", UNSET, "tensorrt_llm_bls/1/model.py:76-77"),
    ),
}


def required_keys(table: dict[str, Parameter]) -> list[str]:
    """The keys whose absence fails the model's load whatever else is set (conditional ones excluded)."""
    return [p.name for p in table.values() if p.missing == FATAL and not p.condition]
