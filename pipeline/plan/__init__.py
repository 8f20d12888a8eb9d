"""The plan stage: what fits on a target, and a build + Triton configuration that agree.

`make_plan` takes the architecture numbers of a model, a target from the catalogue, a precision, a
KV-cache precision, a tensor-parallel size and a workload, and returns a `Plan` for a backend
(`pipeline.backends`: the engine on GPU targets, the reference runtime on the cpu target): a memory
budget, for an engine the TensorRT-LLM 1.2.1 BuildConfig / PluginConfig values and the optimization
profiles trtllm-build will derive from them, the Triton `tensorrt_llm` model parameters, and a roofline
estimate. `save_plan` writes it as plan.json (upstream names as keys), `load_plan` reads it back.

- `schema`: the inputs (Workload, Overrides, ModelInfo), the Plan and its parts, reading plan.json;
- `document`: plan.json as written (the plan and its vLLM/TGI equivalents, `servers`);
- `memory`: bytes of weights, KV cache, activations and runtime reserve; roofline timings;
- `trtllm`: TensorRT-LLM 1.2.1's rules (quantization names, tp/pp layouts, context length, paged
  context FMHA, optimization profiles);
- `policy`: the checks every plan passes and the choice of backend; each backend's own planner is in
  `pipeline.backends.<name>` (batch, tokens, plugins, KV cache);
- `render`: the human-readable tables.
"""

from .memory import kv_bytes_per_token, weights_per_rank_by_stage
from .policy import make_plan
from .render import render_plan
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
    "Workload", "derive_profiles", "is_trtllm_checkpoint", "kv_bytes_per_token", "load_plan", "make_plan",
    "plan_document", "plan_json", "render_plan", "resolve_model_info", "save_plan", "split_num_tokens_range",
    "weights_per_rank_by_stage",
]
