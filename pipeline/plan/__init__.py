"""The plan stage: what fits on a target, and a build + Triton configuration that agree.

`pipeline.planner.make_plan` (above the backends, which build on this package) takes the architecture numbers
of a model, a target from the catalogue, a precision, a KV-cache precision, a tensor-parallel size and a
workload, and returns a `Plan` for a backend (`pipeline.backends`: the engine on GPU targets, the reference
runtime on the cpu target): a memory budget, for an engine the TensorRT-LLM 1.2.1 BuildConfig / PluginConfig
values and the optimization profiles trtllm-build will derive from them, the Triton `tensorrt_llm` model
parameters, and a roofline estimate. `save_plan` writes it as plan.json (upstream names as keys), `load_plan`
reads it back.

- `schema`: the inputs (Workload, Overrides, ModelInfo), the Plan and its parts, reading plan.json;
- `document`: plan.json as written (the plan and its vLLM/TGI equivalents, `servers`);
- `memory`: bytes of weights, KV cache, activations and runtime reserve; roofline timings;
- `trtllm`: TensorRT-LLM 1.2.1's rules (quantization names, tp/pp layouts, context length, paged
  context FMHA, optimization profiles);
- `policy`: the checks every plan passes, and the request they make for a backend's planner
  (`pipeline.backends.<name>`: batch, tokens, plugins, KV cache);
"""

from .memory import kv_bytes_per_token, weights_per_rank_by_stage
from .schema import (
    PLAN_VERSION,
    BuildConfig,
    MemoryBudget,
    ModelInfo,
    Overrides,
    Plan,
    PluginConfig,
    Roofline,
    TritonParams,
    Workload,
    is_trtllm_checkpoint,
    load_plan,
    resolve_model_info,
)
from .document import plan_document, plan_json, save_plan
from .trtllm import derive_profiles, split_num_tokens_range

__all__ = [
    "PLAN_VERSION",
    "BuildConfig", "MemoryBudget", "ModelInfo", "Overrides", "Plan", "PluginConfig", "Roofline", "TritonParams",
    "Workload", "derive_profiles", "is_trtllm_checkpoint", "kv_bytes_per_token", "load_plan",
    "plan_document", "plan_json", "resolve_model_info", "save_plan", "split_num_tokens_range",
    "weights_per_rank_by_stage",
]
