"""What a GPU, a backend and a TensorRT-LLM version can run, as one table of rules (docs/capabilities.md).

Each `Rule` forbids a set of combinations (weight precision x KV cache x backend x SM x TensorRT-LLM version) and
names its source in NVIDIA's support matrices or code, the way out, and one combination it forbids and one it
allows beside it (tests/test_capabilities.py turns each pair into a plan that must be refused or made). plan,
build, the precision hints, `trtpipe verify`/`unpack` and `trtpipe check` ask `refusal` / `runs`; nobody else
restates a rule (`Target.supports_fp8` is the hardware's FP8 tensor cores, the threshold rule fp8-sm89 applies). It
imports only the vocabulary (`backends.names`) and the targets' constants.

What a rule does not forbid but changes (TensorRT-LLM switching paged context FMHA off with a quantized KV cache
unless the weights are FP8) is in `plan/trtllm.py` `paged_context_fmha_possible`, where the engine plan applies it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

from .names import ENGINE, PYTORCH
from ..errors import UserError
from ..precisions import INT4_PRECISIONS
from ..targets import FP8_MIN_SM

#: a Hugging Face checkpoint quantized to FP8 with block scales (`quantization_config.weight_block_size`), as most
#: published FP8 checkpoints are (e.g. Qwen3-*-FP8): an input format, not a precision trtpipe writes
FP8_BLOCK = "fp8-block"
#: nvidia-modelopt's unified checkpoint (`quant_method: modelopt`): its quant_algo as a precision
MODELOPT_PRECISIONS = {"FP8": "fp8", **{algo: precision for precision, algo in INT4_PRECISIONS.items()}}
#: the first TensorRT-LLM line without the engine path
ENGINE_REMOVED_IN = (1, 3)


@dataclass(frozen=True)
class Combination:
    """One deployment as the rules see it: the weights' precision (a `--precision`, "w4a8-awq" or FP8_BLOCK),
    the KV cache as resolved ("fp8", "int8", a float name; None: not decided), the backend, the GPU's SM
    (None: the cpu target) and the TensorRT-LLM version (None: not known)."""

    precision: str
    kv_cache: str | None = None
    backend: str = ENGINE
    sm: int | None = 89
    trtllm: str | None = None

    @property
    def on_gpu(self) -> bool:
        return self.sm is not None


def version_tuple(version: str) -> tuple[int, ...]:
    """'1.3.0rc27' -> (1, 3, 0)."""
    return tuple(int(part) for part in re.findall(r"\d+", version.split("rc")[0])[:3])


@dataclass(frozen=True)
class Rule:
    key: str
    forbids: Callable[[Combination], bool]
    reason: str            # why, formatted with the combination's fields
    way_out: str
    source: str
    refused: Combination   # an example the rule forbids ...
    allowed: Combination   # ... and its neighbour that runs

    def message(self, c: Combination) -> str:
        return (f"{self.reason.format(c=c)}; instead: {self.way_out} (trtpipe's capability table, rule "
                f"{self.key}: {self.source})")


RULES = (
    Rule("fp8-sm89",
         lambda c: c.on_gpu and c.sm < FP8_MIN_SM and "fp8" in (c.precision, c.kv_cache),
         "FP8 weights or KV cache need compute capability 8.9 or newer (Ada, Hopper); this GPU is sm_{c.sm}",
         "--precision fp16/bf16, int8-sq or int4-awq, and --kv-cache fp16/int8",
         "TensorRT-LLM 1.2.1 docs/source/reference/support-matrix.md (FP8 listed for Ada SM89 and Hopper SM90, "
         "not Ampere)",
         Combination("fp8", "fp8", ENGINE, 86), Combination("fp8", "fp8", ENGINE, 89)),
    Rule("w4a8-sm89",
         lambda c: c.on_gpu and c.sm < FP8_MIN_SM and c.precision == "w4a8-awq",
         "W4A8-AWQ (4-bit weights, FP8 activations) needs compute capability 8.9 or newer; this GPU is sm_{c.sm}",
         "--precision int4-awq (W4A16)",
         "TensorRT-LLM 1.2.1 support-matrix.md footnote: \"INT4 AWQ and GPTQ with FP8 activations require "
         "SM >= 89\"",
         Combination("w4a8-awq", None, ENGINE, 86), Combination("int4-awq", None, ENGINE, 86)),
    Rule("pytorch-no-smoothquant",
         lambda c: c.backend == PYTORCH and c.precision == "int8-sq",
         "the PyTorch backend has no INT8 SmoothQuant linear method",
         "--precision fp8 or int4-awq, or --backend engine",
         "tensorrt_llm/_torch/modules/linear.py get_quant_method raises \"unsupported quant mode\"; "
         "docs/source/features/quantization.md lists no W8A8 SmoothQuant for the PyTorch backend",
         Combination("int8-sq", None, PYTORCH, 89), Combination("int8-sq", None, ENGINE, 89)),
    Rule("pytorch-no-int8-kv",
         lambda c: c.backend == PYTORCH and c.kv_cache == "int8",
         "the PyTorch backend has no INT8 KV cache (kv_cache_config.dtype is auto or fp8)",
         "--kv-cache fp8 or auto, or --backend engine",
         "tensorrt_llm/llmapi/llm_args.py KvCacheConfig.dtype (\"auto\" or \"fp8\"); quantization.md KV cache "
         "matrix",
         Combination("fp16", "int8", PYTORCH, 89), Combination("fp16", "fp8", PYTORCH, 89)),
    Rule("fp8-block-sm90",
         lambda c: c.on_gpu and c.precision == FP8_BLOCK and c.sm < 90,
         "a block-scaled FP8 checkpoint needs the FP8 block-scaling GEMM, which sm_{c.sm} does not have",
         "quantize the bf16 original with trtpipe (--precision fp8: per-tensor scales, which Ada runs; or "
         "--precision int4-awq)",
         "NVIDIA/TensorRT-LLM#4599 (\"Unsupported SM version for FP8 block scaling GEMM\" on sm_89); "
         "quantization.md hardware matrix: FP8 block scaling on Hopper and Blackwell, not Ada",
         Combination(FP8_BLOCK, None, PYTORCH, 89), Combination("fp8", None, PYTORCH, 89)),
    Rule("engine-removed-1.3",
         lambda c: c.backend == ENGINE and c.trtllm is not None and version_tuple(c.trtllm) >= ENGINE_REMOVED_IN,
         "TensorRT-LLM {c.trtllm} has no engine path (the 1.3 line removed trtllm-build, the TensorRT runtime and "
         "the inflight_batcher_llm Triton backend)",
         "--backend pytorch, or the engine path on a runtime with TensorRT-LLM 1.2.1 (Triton 26.04-26.07)",
         "NVIDIA/TensorRT-LLM #15763, #15907, #15918 and the migration guide of #15767; v1.3.0rc20 release notes",
         Combination("fp8", "fp8", ENGINE, 89, "1.3.0rc27"), Combination("fp8", "fp8", ENGINE, 89, "1.2.1")),
)
RULES_BY_KEY = {rule.key: rule for rule in RULES}


def refusal(c: Combination) -> Rule | None:
    """The first rule that forbids `c` (None: the table allows it)."""
    return next((rule for rule in RULES if rule.forbids(c)), None)


def runs(c: Combination) -> bool:
    return refusal(c) is None


def require(c: Combination) -> None:
    """UserError with the rule's reason, way out and source when the table forbids `c`."""
    rule = refusal(c)
    if rule is not None:
        raise UserError(rule.message(c))


def runtime_refusal(backend: str, trtllm: str) -> Rule | None:
    """The rule that keeps `backend` off TensorRT-LLM `trtllm` whatever the precision and GPU (None: it may run)."""
    return next((rule for rule in RULES if all(rule.forbids(Combination(p, None, backend, sm, trtllm))
                                               for p in ("fp16", "bf16") for sm in (89, 90))), None)


def runnable(precisions, *, backend: str, sm: int | None, trtllm: str | None = None) -> list[str]:
    """The precisions of `precisions` the table lets `backend` run on `sm` (their default KV cache: the rules on
    a quantized cache are asked again once it is chosen)."""
    return [p for p in precisions if runs(Combination(p, None, backend, sm, trtllm))]


def input_checkpoint_precision(quantization_config: dict | None) -> str | None:
    """The precision of a pre-quantized Hugging Face checkpoint's weights from its config.json
    `quantization_config` (FP8_BLOCK for block-scaled FP8); None for a float checkpoint."""
    if not quantization_config:
        return None
    method = str(quantization_config.get("quant_method", "")).lower()
    if method == "fp8" and quantization_config.get("weight_block_size"):
        return FP8_BLOCK
    if method == "modelopt":
        algo = quantization_config.get("quant_algo")
        return MODELOPT_PRECISIONS.get(algo, str(algo).lower())
    return method or "unknown"
