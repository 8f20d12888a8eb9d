"""The pytorch backend: TensorRT-LLM's LLM API (PyTorch backend) serves the Hugging Face model itself, no engine.

- plan: the engine planner's memory budget (`engine.plan_engine`: the same weights, activations, runtime
  reserve and KV cache for the same batch), expressed as the LLM API's settings (`TorchLlmArgs` keys:
  max_batch_size, max_num_tokens, max_seq_len, kv_cache_config, cuda_graph_config, enable_chunked_prefill)
  in `plan.llm_api`;
- build: no compile stage (the LLM API loads the checkpoint when the server starts); `trtpipe build` deploys
  the Hugging Face twin of its checkpoint (`checkpoint_format` "hf": calibrate's --format both export for
  fp8, the float checkpoint exported back for fp16/bf16, so a GGUF source is served dequantized);
- deploy: Triton's `llmapi` layout: one `tensorrt_llm` Python model whose `1/model.yaml` holds the
  LLM() arguments, whose config.pbtxt declares the llmapi request contract (`LLMAPI_INPUTS` ->
  `LLMAPI_OUTPUTS`) and whose `1/model.py` is trtpipe's (model_repo/llmapi_pytorch: builds LLM() from
  model.yaml and serves that contract; not run here, no GPU) with the `pipeline/triton_names.py` it imports
  (`package_data.copy_model_support`), and beside it at the repository root the same
  settings as a `trtllm-serve` `--extra_llm_api_options` YAML with its launch script. A Hugging Face
  directory given to deploy is copied (hard links where the file system allows) into `1/model/`, and
  model.yaml and the script name it relative to the repository, so the repository names nothing of the
  machine it was written on.

`reference-llmapi` (reference_llmapi.py) is the same contract on the cpu target, served by trtpipe's reference
runtime. The LLM API keys are checked against TensorRT-LLM's recorded list (`llm_api_args`), which
`trtpipe check` uses too.
"""

from __future__ import annotations

import shlex
import shutil
from dataclasses import replace
from pathlib import Path

import yaml

from .. import TRTLLM_VERSION
from ..errors import UserError
from ..outputs import link_or_copy
from ..plan.policy import PlanRequest
from ..plan.schema import LlmApiSettings, Plan, SpeculativePlan
from ..plan.speculative import EAGLE
from ..runtime.speculative import DRAFT, NGRAM
from ..plan.trtllm import paged_context_fmha_possible
from ..tokenizer import TOKENIZER_FILES, copy_tokenizer
from ..triton_names import TENSORRT_LLM
from ..tritonconfig import ModelSpec, TensorSpec, build_model_config, to_pbtxt
from .base import tritonserver_args
from .llm_api_args import MODEL_YAML, unknown_llm_api_keys
from .runtime_images import DEFAULT_IMAGE, IMAGES, RuntimeImage, on_triton
from ..package_data import MODEL_SOURCES, MODEL_SUPPORT_FILES, copy_model_support
from .names import (
    HF_CHECKPOINT,
    INFLIGHT_BATCHING,
    LAUNCH_SCRIPT,
    MODEL_REPOSITORY,
    PYTORCH,
)
from .engine import paged_context_fmha_warning, plan_engine
from .reference import CHECKPOINT_DIR
from ..presets import served_model_id

#: The repository layout of both: NVIDIA's triton_backend/all_models/llmapi (one tensorrt_llm model).
LLMAPI = "llmapi"
LLMAPI_MODELS = (TENSORRT_LLM,)
EXTRA_OPTIONS = "extra_llm_api_options.yaml"
#: The served Hugging Face model inside the version directory (model.yaml's `model` when deploy copied it).
SERVED_MODEL_DIR = "model"
#: a local draft model's copy, beside the served model (the LLM API's speculative_model_dir names it)
DRAFT_MODEL_DIR = "draft"
#: Files of a Hugging Face model directory the LLM API reads besides its weights and tokenizer files.
HF_MODEL_FILES = ("config.json", "hf_quant_config.json", "model.safetensors.index.json")
#: The cpu flavour's model source, copied into REPO/tensorrt_llm/1/.
LLMAPI_MODEL_SOURCE = MODEL_SOURCES / "llmapi" / TENSORRT_LLM / "1" / "model.py"
#: The GPU flavour's: the LLM API serving model.yaml's model (trtpipe's own; docs/pytorch-backend.md says why).
PYTORCH_MODEL_SOURCE = MODEL_SOURCES / "llmapi_pytorch" / TENSORRT_LLM / "1" / "model.py"
#: The LLM API's guided-decoding backend (llm_args.py `guided_decoding_backend: Literal["xgrammar", "llguidance"]`,
#: default None; xgrammar runs on both of TensorRT-LLM's backends): what enforces an OpenAI `response_format`.
GUIDED_DECODING_BACKEND = "xgrammar"
#: The options file of a trtllm-serve deployment on an image without Triton (`--config` names it).
SERVE_CONFIG = "config.yaml"
#: LLM API SamplingParams' default max_tokens, used when a request leaves sampling_param_max_tokens unset.
DEFAULT_MAX_TOKENS = 32

#: The llmapi request contract (NVIDIA's llmapi config.pbtxt @0a710573, the part trtpipe declares): the
#: request is text plus `sampling_param_*`; `streaming` asks for one response per new piece of text.
LLMAPI_INPUTS = (
    TensorSpec("text_input", "TYPE_STRING", (-1,)),
    TensorSpec("streaming", "TYPE_BOOL", (1,), optional=True),
    TensorSpec("sampling_param_max_tokens", "TYPE_INT32", (1,), optional=True),
    TensorSpec("sampling_param_temperature", "TYPE_FP32", (1,), optional=True),
    TensorSpec("sampling_param_top_k", "TYPE_INT32", (1,), optional=True),
    TensorSpec("sampling_param_top_p", "TYPE_FP32", (1,), optional=True),
    TensorSpec("sampling_param_seed", "TYPE_UINT64", (1,), optional=True),
    TensorSpec("sampling_param_exclude_input_from_output", "TYPE_BOOL", (1,), optional=True),
    TensorSpec("return_finish_reason", "TYPE_BOOL", (1,), optional=True),
)
LLMAPI_OUTPUTS = (TensorSpec("text_output", "TYPE_STRING", (-1,)), TensorSpec("finish_reason", "TYPE_STRING", (-1,)))
#: Engine-build options the LLM API has no counterpart for.
ENGINE_ONLY_OPTIONS = {"opt_num_tokens": "--opt-num-tokens", "multiple_profiles": "--multiple-profiles",
                       "use_paged_context_fmha": "--paged-context-fmha"}


class PytorchBackend:
    name = PYTORCH
    triton_backend = "python"
    target_kinds = ("gpu",)
    builds_engine = False
    exact_checkpoint_dtype = True   # irrelevant: it plans from the Hugging Face model, never a TRT-LLM checkpoint
    serves_embedded = False         # needs a GPU and TensorRT-LLM: --url
    memory_scope = "per GPU"
    layout = LLMAPI
    batching = INFLIGHT_BATCHING
    request_priorities = False   # the llmapi model.py passes none; 1.2.1's LLM API priority is not established
    sparse_kernels = False       # no 2:4 kernels on TensorRT-LLM's PyTorch backend (docs/sparsity.md)
    profile_start_stop_env = "TLLM_PROFILE_START_STOP"        # the PyTorch executor (docs/upstream-facts.md K)
    checkpoint_format = HF_CHECKPOINT
    #: the LLM API's speculative_config classes (NGramDecodingConfig, DraftTargetDecodingConfig, one-model
    #: EagleDecodingConfig / 1.3's Eagle3DecodingConfig)
    speculative_methods = {NGRAM: "NGram", DRAFT: "DraftTarget", EAGLE: "Eagle3"}
    drafts_through_bls = False

    def configure_speculation(self, plan: Plan) -> Plan:
        """The LLM API's `speculative_config` for the plan's TensorRT-LLM version (none when no batch gains: the
        deployment decodes plainly)."""
        spec = plan.speculative
        if not spec.max_rows:
            return plan
        config = speculative_config(spec, plan.llm_api.tensorrt_llm_version)
        reasons = {**plan.llm_api.reasons, "speculative_config": (
            f"--speculative {spec.method} K {spec.draft_len}; max_concurrency {spec.max_rows}: the most rows at "
            "which every predicted speedup is above 1 (above it the LLM API decodes plainly)")}
        llm_api = replace(plan.llm_api, options={**plan.llm_api.options, "speculative_config": config},
                          reasons=reasons)
        return replace(plan, llm_api=llm_api, speculative=replace(spec, decoding_mode=config["decoding_type"]))
    summary = (f"no engine: TensorRT-LLM {TRTLLM_VERSION}'s LLM API (PyTorch backend) serves the Hugging Face "
               "model (Triton llmapi model, or trtllm-serve)")

    def plan(self, request: PlanRequest) -> Plan:
        return plan_pytorch(request)

    def checkpoint_dtype(self, plan: Plan) -> str:
        return plan.dtype

    def build_artifact(self, checkpoint: Path, plan: Plan, out: Path, *, dry_run: bool, force: bool) -> None:
        """Nothing to build: the LLM API loads the Hugging Face checkpoint when the server starts."""
        return None

    def check_artifacts(self, engine: Path | None, checkpoint: Path | None) -> tuple[Path | None, Path | None]:
        if engine is not None:
            raise UserError("the pytorch backend serves the Hugging Face model with no engine: drop --engine")
        if checkpoint is None:
            return None, None
        checkpoint = Path(checkpoint).resolve()
        if not (checkpoint / "config.json").is_file():
            raise UserError(f"--checkpoint {checkpoint} has no config.json; the pytorch backend loads a Hugging "
                            "Face model directory (or leave --checkpoint out to serve the plan's model)")
        from ..plan.schema import is_trtllm_checkpoint

        if is_trtllm_checkpoint(checkpoint):
            raise UserError(f"--checkpoint {checkpoint} is a TensorRT-LLM checkpoint; the pytorch backend loads "
                            "Hugging Face checkpoints: pass the Hugging Face model directory (calibrate "
                            "--format both writes one to OUT/hf)")
        if not any(checkpoint.glob("*.safetensors")):
            raise UserError(f"--checkpoint {checkpoint} has no *.safetensors weights; pass a Hugging Face model "
                            "directory with safetensors weights")
        if not any((checkpoint / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
            raise UserError(f"--checkpoint {checkpoint} has no tokenizer files (tokenizer.json / "
                            "tokenizer_config.json); the LLM API tokenizes with the model directory's tokenizer")
        return None, checkpoint

    def repository_inputs(self, engine: Path | None, checkpoint: Path | None) -> list[Path]:
        if not PYTORCH_MODEL_SOURCE.is_file():
            raise UserError(f"trtpipe's model source {PYTORCH_MODEL_SOURCE} is missing; reinstall trtpipe")
        return [PYTORCH_MODEL_SOURCE, *MODEL_SUPPORT_FILES, *(served_files(checkpoint) if checkpoint else [])]

    def model_parameters(self, plan: Plan, engine: Path | None) -> dict[str, str]:
        return {}

    def write_model(self, version_dir: Path, checkpoint: Path | None) -> None:
        """model.py (the LLM API behind the llmapi contract) with the package files it imports, and the served
        Hugging Face model in `1/model/` (model.yaml is written by `write_llmapi_repository`)."""
        shutil.copyfile(PYTORCH_MODEL_SOURCE, version_dir / "model.py")
        copy_model_support(version_dir)
        if checkpoint is not None:
            copy_served_model(checkpoint, version_dir / SERVED_MODEL_DIR)

    def serve_command(self, plan: Plan, model_repository: str = MODEL_REPOSITORY,
                      extra_args: tuple[str, ...] = ()) -> list[str]:
        """One tritonserver: the llmapi model starts the LLM API's own workers for tp x pp GPUs; on an image
        without Triton, the trtllm-serve launch script."""
        if not serves_on_triton(plan):
            return ["sh", LAUNCH_SCRIPT, *extra_args]
        return tritonserver_args(model_repository, 0, extra_args)


BACKEND = PytorchBackend()


# ----------------------------------------------------------------------------------------------
# The plan


#: `speculative_config.decoding_type` per TensorRT-LLM version line: 1.2.x parses the dict through
#: DecodingBaseConfig.from_dict's class map ("DraftTarget"); 1.3 through a pydantic union discriminated by each
#: class's Literal ("Draft_Target"), no alias (docs/upstream-facts.md S7)
DECODING_TYPES = {"1.2": {NGRAM: "NGram", DRAFT: "DraftTarget", EAGLE: "Eagle"},
                  "1.3": {NGRAM: "NGram", DRAFT: "Draft_Target", EAGLE: "Eagle3"}}


def speculative_config(spec: SpeculativePlan, version: str) -> dict:
    """The LLM API's `speculative_config` for TensorRT-LLM `version`: K, max_concurrency (1.3: a positive int, so
    written only when some batch gains), the n-gram size (1.2.x's default 0 matches nothing useful) or the draft
    (`speculative_model_dir`: 1.2.x's field, 1.3's alias of speculative_model); an EAGLE-3 head one-model (the
    draft layers run inside the target's forward pass, both lines' default, said explicitly)."""
    line = "1.2" if version.startswith("1.2") else "1.3"
    config = {"decoding_type": DECODING_TYPES[line][spec.method], "max_draft_len": spec.draft_len,
              "max_concurrency": spec.max_rows}
    if spec.method == NGRAM:
        config["max_matching_ngram_size"] = spec.max_ngram
    else:
        config["speculative_model_dir"] = spec.draft_served
    if spec.method == EAGLE:
        config["eagle3_one_model"] = True
    return config


def cuda_graph_batch_sizes(expected: int, max_batch_size: int) -> list[int]:
    """Powers of two up to the expected number of concurrent requests, and that number itself (at most
    max_batch_size). With enable_padding a batch runs in the next captured size; larger batches run eagerly,
    so no graph (up to 200 MB each, CudaGraphConfig docs) is captured for a batch the workload never has."""
    top = max(1, min(expected, max_batch_size))
    sizes = [1 << i for i in range(top.bit_length()) if 1 << i < top]
    return [*sizes, top]


def plan_pytorch(request: PlanRequest) -> Plan:
    """The engine plan's budget for the same request, as LLM API settings (no engine, no plugins, no profiles)."""
    given = [flag for field, flag in ENGINE_ONLY_OPTIONS.items() if getattr(request.overrides, field) is not None]
    if given:
        raise UserError(f"{', '.join(given)} are engine-build options; the {PYTORCH} backend builds no engine "
                        "(use --backend engine, or drop them)")
    if request.model.source == "checkpoint":
        raise UserError(f"{request.model.path} is a TensorRT-LLM checkpoint; the {PYTORCH} backend loads the "
                        "Hugging Face model: plan from the preset, the Hugging Face directory or the hub id")
    base = plan_engine(request)
    batch, kv_tokens = base.build_config.max_batch_size, base.memory.kv_cache_tokens
    expected = request.workload.concurrency or base.max_concurrent_sequences
    reuse = bool(base.triton.enable_kv_cache_reuse)
    options = {
        "tensor_parallel_size": request.tp,
        "pipeline_parallel_size": request.pp,
        "max_batch_size": batch,
        "max_num_tokens": base.build_config.max_num_tokens,
        "max_seq_len": base.max_seq_len,
        "enable_chunked_prefill": True,
        "kv_cache_config": {
            "free_gpu_memory_fraction": base.memory.kv_cache_free_gpu_mem_fraction,
            "dtype": "fp8" if request.kv_cache_dtype == "fp8" else "auto",
            "enable_block_reuse": reuse,
            "max_tokens": kv_tokens,
        },
        "cuda_graph_config": {"batch_sizes": cuda_graph_batch_sizes(expected, batch), "enable_padding": True},
        "guided_decoding_backend": GUIDED_DECODING_BACKEND,
    }
    reasons = {
        "max_batch_size": "the engine planner's batch: the most sequences of input_len + output_len tokens whose "
                          "KV cache fits beside that batch's activations and runtime reserve",
        "kv_cache_config.max_tokens": "the planned KV cache in tokens; the LLM API takes the smaller of this and "
                                      "free_gpu_memory_fraction x the free memory it measures",
        "cuda_graph_config.batch_sizes": f"powers of two up to the expected concurrency {expected} "
                                         f"(--concurrency, else the sequences the KV cache holds)",
        "enable_chunked_prefill": "long prompts are prefilled in max_num_tokens chunks, as the engine's "
                                  "chunked context",
        "guided_decoding_backend": "trtllm-serve turns an OpenAI response_format into guided-decoding parameters "
                                   "and, without a backend, does not enforce them: xgrammar enforces them",
    }
    # Paged context FMHA is an engine plugin: the PyTorch backend's attention has no such restriction.
    _, why = paged_context_fmha_possible(request.precision, request.kv_cache_dtype)
    warnings = [w for w in base.warnings if not why or w != paged_context_fmha_warning(why)]
    triton = replace(base.triton, triton_backend="python", batching_strategy=None, enable_chunked_context=True)
    return replace(base, backend=PYTORCH, engine=None, build_config=None, plugin_config=None,
                   optimization_profiles=[], triton=triton, warnings=warnings,
                   llm_api=LlmApiSettings(request.trtllm or TRTLLM_VERSION, options, reasons))


# ----------------------------------------------------------------------------------------------
# The repository


def model_yaml(plan: Plan, model: str, options: dict) -> dict:
    """tensorrt_llm/1/model.yaml: the LLM() arguments, and how Triton treats the model (`triton_config`)."""
    extra = {"backend": "pytorch"} if plan.backend == PYTORCH else {}
    return {"model": model, **extra, **options, "triton_config": {"max_batch_size": 0, "decoupled": True}}


def local_draft(plan: Plan) -> Path | None:
    """The local Hugging Face directory a draft-target or EAGLE-3 plan drafts with (deploy copies it into the
    deployment), else None (a hub id, downloaded where it is served)."""
    spec = plan.speculative
    configured = plan.llm_api is not None and "speculative_config" in plan.llm_api.options   # not when none gains
    served = spec.draft_served if configured else None
    return Path(served) if served and Path(served).is_absolute() else None


def drafting_from(options: dict, where: str) -> dict:
    """The LLM API options with their draft model named `where` (its copy in the deployment, relative to where the
    options are read)."""
    config = options["speculative_config"]
    return {**options, "speculative_config": {**config, "speculative_model_dir": where}}


def llmapi_config(plan: Plan):
    """The tensorrt_llm model's config.pbtxt (a ModelConfig message): the llmapi contract, decoupled for
    streaming, unbatched by Triton (the LLM API batches in flight), as NVIDIA's llmapi model."""
    spec = ModelSpec(TENSORRT_LLM, 0, LLMAPI_INPUTS, LLMAPI_OUTPUTS, backend="python", decoupled=True,
                     instance_count=1)
    return build_model_config(spec)


def plan_image(plan: Plan) -> RuntimeImage:
    """The GPU runtime image the plan deploys onto (a plan written before images were recorded: the default)."""
    return IMAGES.get(plan.runtime_image) or IMAGES[DEFAULT_IMAGE[PYTORCH]]


def serves_on_triton(plan: Plan) -> bool:
    """Whether the plan's deployment is a Triton repository (False: a trtllm-serve deployment alone)."""
    return on_triton(plan.runtime_image)


def checked_llm_api_options(plan: Plan) -> dict:
    """The plan's LLM API options, every key checked against the recorded list of the plan's TensorRT-LLM."""
    if not plan.llm_api:
        raise UserError(f"the plan for the {plan.backend} backend has no llm_api settings; re-run `trtpipe plan`")
    unknown = unknown_llm_api_keys(plan.llm_api.options, False, plan.llm_api.tensorrt_llm_version)
    if unknown:
        raise UserError(f"the plan's LLM API options {', '.join(k for k, _ in unknown)} are not arguments of "
                        f"TensorRT-LLM {plan.llm_api.tensorrt_llm_version}; re-run `trtpipe plan` with this trtpipe")
    return plan.llm_api.options


def write_trtllm_serve_deployment(out: Path, plan: Plan, checkpoint: Path | None) -> None:
    """An image without Triton: the LLM API options as trtllm-serve's YAML, its launch script, and the served
    Hugging Face model in `model/` (none: the plan's hub id, downloaded by trtllm-serve)."""
    image = plan_image(plan)
    options = checked_llm_api_options(plan)
    draft = local_draft(plan)
    if draft is not None:
        copy_served_model(draft, out / DRAFT_MODEL_DIR)
        options = drafting_from(options, DRAFT_MODEL_DIR)
    (out / SERVE_CONFIG).write_text(yaml.safe_dump(options, sort_keys=False))
    if checkpoint is not None:
        copy_served_model(checkpoint, out / SERVED_MODEL_DIR)
    write_launch_script(out, image, SERVED_MODEL_DIR if checkpoint else served_model_id(plan.model), SERVE_CONFIG)


def write_launch_script(out: Path, image: RuntimeImage, model: str, options_file: str) -> None:
    script = out / LAUNCH_SCRIPT
    script.write_text("\n".join(["#!/bin/sh", f"# {image.image} (TensorRT-LLM {image.trtllm}): the plan's settings "
                                 f"in {options_file} (beside this script)", "set -e", 'cd "$(dirname "$0")"',
                                 "exec " + shlex.join(trtllm_serve_command(model, image, options_file)), ""]))
    script.chmod(0o755)


def write_llmapi_repository(repo: Path, plan: Plan, checkpoint: Path | None, tokenizer: Path | None) -> None:
    """config.pbtxt and model.yaml of the one model; for pytorch also the trtllm-serve YAML and launch script."""
    options = checked_llm_api_options(plan)
    version_dir = repo / TENSORRT_LLM / "1"
    version_dir.mkdir(parents=True)
    (repo / TENSORRT_LLM / "config.pbtxt").write_text(to_pbtxt(llmapi_config(plan)))
    draft = local_draft(plan) if plan.backend == PYTORCH else None
    if draft is not None:     # named relative to the version directory in model.yaml, to the root in the YAML
        copy_served_model(draft, version_dir / DRAFT_MODEL_DIR)
    in_version = drafting_from(options, DRAFT_MODEL_DIR) if draft else options
    if plan.backend == PYTORCH:
        model = SERVED_MODEL_DIR if checkpoint else served_model_id(plan.model)
        served = f"tensorrt_llm/1/{SERVED_MODEL_DIR}" if checkpoint else model
        at_root = drafting_from(options, f"tensorrt_llm/1/{DRAFT_MODEL_DIR}") if draft else options
        (repo / EXTRA_OPTIONS).write_text(yaml.safe_dump(at_root, sort_keys=False))
        write_launch_script(repo, plan_image(plan), served, EXTRA_OPTIONS)
    else:
        model = CHECKPOINT_DIR
        copy_tokenizer(tokenizer, version_dir / "tokenizer")
    (version_dir / MODEL_YAML).write_text(yaml.safe_dump(model_yaml(plan, model, in_version), sort_keys=False))


def served_files(checkpoint: Path) -> list[Path]:
    """The files of a Hugging Face model directory the LLM API loads: config, weights, tokenizer (PyTorch's
    pytorch_model.bin where there are no safetensors: EAGLE-3 heads ship one)."""
    named = [checkpoint / name for name in (*HF_MODEL_FILES, *TOKENIZER_FILES) if (checkpoint / name).is_file()]
    weights = sorted(checkpoint.glob("*.safetensors"))
    return named + (weights or [p for p in [checkpoint / "pytorch_model.bin"] if p.is_file()])


def copy_served_model(checkpoint: Path, dest: Path) -> None:
    """`served_files` of `checkpoint` into `dest`; hard links where the file system allows (weights are big)."""
    dest.mkdir(parents=True)
    for f in served_files(checkpoint):
        link_or_copy(f, dest / f.name)


def trtllm_serve_command(model: str, image: RuntimeImage, options_file: str = EXTRA_OPTIONS) -> list[str]:
    """trtllm-serve with the plan's YAML, named by the image's flag (§4.2: the YAML overrides trtllm-serve's own
    flags; 1.3 names it --config)."""
    return ["trtllm-serve", model, "--backend", "pytorch", "--host", "0.0.0.0", "--port", "8000",
            image.options_flag, options_file]
