"""A TensorRT-LLM checkpoint directory, typed: its config.json (`CheckpointConfig`) and its rank files
(`RankFile`, opened by `open_rank_files`).

convert writes it, calibrate reads the float one and writes its quantized twin, the reference runtime
and plan read it. The shared PretrainedConfig keys are written here; the family adds its own
(`Family.checkpoint_fields`: LLaMAConfig's or QWenConfig's). Keys this class does not model are kept
as read, so a config that passes through (calibrate) loses nothing.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, replace
from fnmatch import fnmatch
from pathlib import Path
from typing import TYPE_CHECKING

from . import __version__
from .arch import ModelArch
from .errors import UserError, read_config_json
from .outputs import read_manifest, recorded_path
from .precisions import CHECKPOINT_DTYPES, INT4_QUANT_ALGOS
from .model.layout import Rank, RankLayout, kv_heads_per_rank
from .model.spec import Family
from .safetensors_stream import SafetensorsFile
from .model import family_of
from .model.arch_config import arch_from_checkpoint_config

if TYPE_CHECKING:
    from .sparsity.pattern import SparsityClaim

LAYER_TENSOR = re.compile(r"^transformer\.layers\.(\d+)\.(.+)$")
#: the output projection's module name in a TensorRT-LLM checkpoint
LM_HEAD = "lm_head"
LM_HEAD_WEIGHT = LM_HEAD + ".weight"
#: TensorRT-LLM's `quantize_layers` exclusions when a checkpoint's exclude_modules is null or empty
#: (tensorrt_llm/quantization/quantize.py; docs/upstream-facts.md): lm_head stays in the model dtype
TRTLLM_DEFAULT_EXCLUDE = ("*lm_head", "*router", "*vocab_embedding", "*position_embedding", "*block_embedding",
                          "*shared_expert_gate", "*fused_a")


@dataclass(frozen=True)
class CheckpointConfig:
    arch: ModelArch
    dtype: str
    layout: RankLayout
    quantization: dict = field(default_factory=dict)   # quant_algo, kv_cache_quant_algo, exclude_modules, ...
    use_parallel_embedding: bool = False
    embedding_sharding_dim: int = 0
    share_embedding_table: bool = False
    logits_dtype: str = "float32"
    raw: dict = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def new(cls, arch: ModelArch, dtype: str, tp: int = 1, pp: int = 1) -> "CheckpointConfig":
        """The config convert writes for `arch` sharded tp x pp (UserError for a layout it cannot take)."""
        if dtype not in CHECKPOINT_DTYPES:
            raise UserError(f"unsupported dtype {dtype!r}; choose one of {', '.join(CHECKPOINT_DTYPES)}")
        return cls(arch, dtype, RankLayout.for_arch(arch, tp, pp))

    @classmethod
    def from_dict(cls, raw: dict, where: str) -> "CheckpointConfig":
        arch = arch_from_checkpoint_config(raw, where)
        dtype = raw.get("dtype")
        if dtype not in CHECKPOINT_DTYPES:
            raise UserError(f"{where}: dtype {dtype!r} is not one of {', '.join(CHECKPOINT_DTYPES)}")
        mapping = raw.get("mapping") or {}
        try:
            tp, pp = int(mapping.get("tp_size", 1)), int(mapping.get("pp_size", 1))
            world = int(mapping.get("world_size", tp * pp))
        except (TypeError, ValueError):
            raise UserError(f"{where}: mapping {mapping!r} does not hold integer sizes") from None
        try:
            layout = RankLayout.for_arch(arch, tp, pp, tp_name="mapping.tp_size", pp_name="mapping.pp_size")
        except UserError as exc:
            raise UserError(f"{where}: {exc}") from None
        if world != tp * pp:
            raise UserError(f"{where}: mapping.world_size {world} is not tp_size x pp_size = {tp * pp}")
        return cls(arch, dtype, layout, dict(raw.get("quantization") or {}),
                   bool(raw.get("use_parallel_embedding", False)), int(raw.get("embedding_sharding_dim", 0)),
                   bool(raw.get("share_embedding_table", False)), str(raw.get("logits_dtype", "float32")), raw)

    @classmethod
    def read(cls, ckpt_dir: Path) -> "CheckpointConfig":
        raw = read_config_json(ckpt_dir, f"{ckpt_dir} has no config.json; it is not a TensorRT-LLM checkpoint "
                                         "directory (create one with `trtpipe convert`)")
        return cls.from_dict(raw, str(Path(ckpt_dir) / "config.json"))

    @property
    def family(self) -> Family:
        return family_of(self.arch.architecture)

    @property
    def quant_algo(self) -> str | None:
        return self.quantization.get("quant_algo")

    @property
    def kv_cache_quant_algo(self) -> str | None:
        return self.quantization.get("kv_cache_quant_algo")

    @property
    def exclude_modules(self) -> tuple[str, ...]:
        return excluded_modules(self.quantization)

    @property
    def is_quantized(self) -> bool:
        return bool(self.quant_algo or self.kv_cache_quant_algo)

    def quantizes(self, module: str) -> bool:
        """Whether the linear `module` (global name) is stored quantized."""
        if self.quant_algo is None:
            return False
        return not is_excluded(module, self.exclude_modules)

    @property
    def quantized_lm_head(self) -> bool:
        return quantizes_lm_head(self.quantization)

    @property
    def q_heads_per_rank(self) -> int:
        return self.arch.num_attention_heads // self.layout.tp

    @property
    def kv_heads_per_rank(self) -> int:
        return kv_heads_per_rank(self.arch.num_key_value_heads, self.layout.tp)

    def with_quantization(self, quantization: dict) -> "CheckpointConfig":
        return replace(self, quantization=dict(quantization))

    @property
    def sparsity(self) -> "SparsityClaim | None":
        """The 2:4 claim config.json makes (`trtpipe sparsify` writes it); None for a dense checkpoint."""
        from .sparsity.pattern import claim_of

        return claim_of(self.raw, "config.json")

    def with_sparsity(self, claim: "SparsityClaim") -> "CheckpointConfig":
        from .sparsity.pattern import CONFIG_KEY

        return replace(self, raw={**(self.raw or self.to_dict()), CONFIG_KEY: claim.to_dict()})

    def to_dict(self) -> dict:
        a = self.arch
        written = {
            "producer": {"name": "trtpipe", "version": __version__},
            "architecture": a.architecture,
            "dtype": self.dtype,
            "logits_dtype": self.logits_dtype,
            "vocab_size": a.vocab_size,
            "max_position_embeddings": a.max_position_embeddings,
            "hidden_size": a.hidden_size,
            "num_hidden_layers": a.num_hidden_layers,
            "num_attention_heads": a.num_attention_heads,
            "num_key_value_heads": a.num_key_value_heads,
            "head_size": a.head_size,
            "intermediate_size": a.intermediate_size,
            "hidden_act": a.hidden_act,
            "norm_epsilon": a.norm_epsilon,
            "position_embedding_type": "rope_gpt_neox",
            "rotary_base": a.rotary_base,
            "rotary_scaling": a.rotary_scaling,
            "use_parallel_embedding": self.use_parallel_embedding,
            "embedding_sharding_dim": self.embedding_sharding_dim,
            "tie_word_embeddings": a.tie_word_embeddings,
            "mapping": self.layout.mapping(),
            "quantization": {"quant_algo": None, "kv_cache_quant_algo": None, **self.quantization},
            **self.family.checkpoint_fields(a),
        }
        if self.raw:     # keep what was read, update what this class owns
            return {**self.raw, **{k: v for k, v in written.items() if k != "producer"},
                    "producer": self.raw.get("producer", written["producer"])}
        return written

    def write(self, directory: Path) -> None:
        (Path(directory) / "config.json").write_text(json.dumps(self.to_dict(), indent=2) + "\n")


def excluded_modules(quantization: dict) -> tuple[str, ...]:
    """The modules a checkpoint's `quantization` leaves unquantized: its exclude_modules, or TensorRT-LLM's default
    list when that is null or empty (its `quantize_layers` reads `exclude_modules or [...]`: lm_head stays float)."""
    return tuple(quantization.get("exclude_modules") or TRTLLM_DEFAULT_EXCLUDE)


def quantizes_lm_head(quantization: dict) -> bool:
    """lm_head is stored as 4-bit groupwise weights (trtpipe writes it only for `calibrate --quantize-lm-head`)."""
    return quantization.get("quant_algo") in INT4_QUANT_ALGOS and not is_excluded(LM_HEAD,
                                                                                  excluded_modules(quantization))


def written_exclude_modules(quantize_lm_head: bool, exclude: tuple[str, ...] = ()) -> list[str]:
    """The exclude_modules calibrate writes: lm_head and `exclude`; for a quantized lm_head a list that is not empty
    and does not name it (an empty one is TensorRT-LLM's default list, which keeps lm_head float)."""
    kept = [p for p in TRTLLM_DEFAULT_EXCLUDE if not is_excluded(LM_HEAD, (p,))] if quantize_lm_head else [LM_HEAD]
    return [*kept, *exclude]


def is_excluded(module: str, patterns: tuple[str, ...]) -> bool:
    """modelopt's exclude_modules matching: a glob on the module name, or the module's last components."""
    return any(fnmatch(module, p) or module.endswith("." + p) for p in patterns)


@dataclass(frozen=True)
class RankFile:
    """One rank file: where it sits in the mapping and its tensors, read on demand (local layer names)."""

    position: Rank
    path: Path
    file: SafetensorsFile = field(repr=False, compare=False)

    @property
    def rank(self) -> int:
        return self.position.rank

    @property
    def tp_rank(self) -> int:
        return self.position.tp_rank

    @property
    def pp_rank(self) -> int:
        return self.position.pp_rank

    @property
    def layer_offset(self) -> int:
        """The global index of this file's local layer 0."""
        return self.position.layers.start

    def names(self) -> set[str]:
        return self.file.names()

    def read(self, name: str, rows: tuple[int, int] | None = None):
        return self.file.read(name, rows)

    def maybe(self, name: str):
        return self.read(name) if name in self.file.names() else None

    def global_name(self, name: str) -> str:
        m = LAYER_TENSOR.match(name)
        return f"transformer.layers.{int(m.group(1)) + self.layer_offset}.{m.group(2)}" if m else name


def open_rank_files(ckpt_dir: Path, cfg: CheckpointConfig) -> list[RankFile]:
    """The rank files config.json's mapping calls for, each holding its stage's layers (UserError otherwise)."""
    ckpt_dir, layout = Path(ckpt_dir), cfg.layout
    names = {pos.file_name for pos in layout.ranks}
    missing = sorted(n for n in names if not (ckpt_dir / n).is_file())
    mapping = f"config.json mapping tp={layout.tp} pp={layout.pp}"
    if missing:
        raise UserError(f"{ckpt_dir}: missing {', '.join(missing)} ({mapping} = {layout.world_size} ranks)")
    extra = sorted(p.name for p in ckpt_dir.glob("rank*.safetensors") if p.name not in names)
    if extra:
        raise UserError(f"{ckpt_dir}: unexpected {', '.join(extra)} for a {layout.world_size}-rank checkpoint "
                        f"({mapping})")
    files = [RankFile(pos, ckpt_dir / pos.file_name, SafetensorsFile(ckpt_dir / pos.file_name))
             for pos in layout.ranks]
    for rf in files:
        found = {int(m.group(1)) for m in map(LAYER_TENSOR.match, rf.names()) if m}
        if found != set(range(layout.layers_per_stage)):
            raise UserError(f"{rf.path}: the rank file holds {len(found)} layers (local {_span(found)}) but "
                            f"config.json says num_hidden_layers={layout.num_layers} over pp={layout.pp} stages "
                            f"(local layers 0..{layout.layers_per_stage - 1} each)")
    return files


def _span(indices: set[int]) -> str:
    if not indices:
        return "none"
    ordered = sorted(indices)
    contiguous = ordered == list(range(ordered[0], ordered[-1] + 1))
    return f"{ordered[0]}..{ordered[-1]}" if contiguous else ", ".join(map(str, ordered))


#: The stages whose checkpoint is still the model it was converted from (calibrate only quantizes it); sparsify and
#: distill change the weights, so the source model is no reference for what they wrote.
SAME_MODEL_STAGES = {"convert": "source", "calibrate": "source_model"}


def source_model(checkpoint: Path) -> str | None:
    """The model CHECKPOINT was made from, as its stage's manifest records it (convert's `source`, carried on by
    calibrate): a preset or hub id as named, a local directory or GGUF file as this machine's path again. None
    for a checkpoint made elsewhere or by a stage that changed its weights."""
    manifest = read_manifest(Path(checkpoint)) or {}
    recorded = manifest.get(SAME_MODEL_STAGES.get(manifest.get("stage"), ""))
    return recorded_path(recorded, Path(checkpoint).absolute().parent) if isinstance(recorded, str) else None
