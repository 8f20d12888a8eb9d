"""The convert stage: Hugging Face Llama/Mistral weights -> TensorRT-LLM 1.2.x unified checkpoint.

The layout follows TensorRT-LLM's own converter (`tensorrt_llm/models/llama/convert.py`, see
upstream-facts A1): q/k/v fused in Q,K,V order into `attention.qkv`, `gate_proj -> mlp.fc`,
`up_proj -> mlp.gate`, `down_proj -> mlp.proj`; column-parallel linears split on dim 0, row-parallel
ones on dim 1; K/V heads duplicated when tp > num_kv_heads; lm_head padded to a multiple of tp; each
pipeline rank holds its contiguous layers (named with local indices), the embedding on the first and
ln_f/lm_head on the last. Tensors are read slice by slice from the memory-mapped source and each rank
file is streamed to disk, so peak memory follows the largest tensor, not the model.
"""

from __future__ import annotations

import ctypes
import json
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

from . import TRTLLM_VERSION, __version__
from .arch import ModelArch
from .errors import UserError
from .outputs import (atomic_output_dir, check_output_free, fingerprint_inputs, is_up_to_date,
                      write_manifest)
from .safetensors_stream import LazyWeights, SafetensorsWriter, SourceRows, TensorSpec, torch_dtype
from .sources import ModelSource, read_hf_arch

if TYPE_CHECKING:
    import torch

#: checkpoint dtype -> safetensors code of its tensors
DTYPES = {"float16": "F16", "bfloat16": "BF16", "float32": "F32"}
STAGE = "convert"


@dataclass(frozen=True)
class RankPosition:
    """One rank of the tp x pp mapping (TensorRT-LLM's Mapping: rank = pp_rank * tp_size + tp_rank)."""

    tp_rank: int
    pp_rank: int
    tp_size: int
    pp_size: int

    @property
    def rank(self) -> int:
        return self.pp_rank * self.tp_size + self.tp_rank

    def layers(self, num_layers: int) -> range:
        per_rank = num_layers // self.pp_size
        return range(self.pp_rank * per_rank, (self.pp_rank + 1) * per_rank)

    @property
    def is_first_pp(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_pp(self) -> bool:
        return self.pp_rank == self.pp_size - 1


@dataclass(frozen=True)
class ConvertResult:
    path: Path
    config: dict
    skipped: bool
    seconds: float
    bytes_written: int

    def to_dict(self) -> dict:
        return {"checkpoint": str(self.path), "skipped": self.skipped, "seconds": round(self.seconds, 3),
                "bytes": self.bytes_written, "tp_size": self.config["mapping"]["tp_size"],
                "pp_size": self.config["mapping"]["pp_size"], "dtype": self.config["dtype"]}

    def summary(self) -> str:
        if self.skipped:
            return f"checkpoint {self.path} is up to date (inputs unchanged); nothing to do"
        m = self.config["mapping"]
        return (f"wrote TensorRT-LLM {TRTLLM_VERSION} checkpoint {self.path}: {self.config['architecture']}, "
                f"{self.config['dtype']}, tp={m['tp_size']} pp={m['pp_size']}, "
                f"{self.bytes_written / 1e6:.1f} MB in {self.seconds:.1f} s")


def convert_model(source: ModelSource, out: Path, *, dtype: str | None = None, tp: int = 1, pp: int = 1,
                  force: bool = False, progress: bool = True) -> ConvertResult:
    """Convert `source` into a TensorRT-LLM checkpoint at `out` (a no-op when `out` is up to date)."""
    out = Path(out)
    hf_dir = source.hf_dir()
    arch = read_hf_arch(hf_dir)
    dtype = dtype or arch.dtype
    if dtype not in DTYPES:
        raise UserError(f"unsupported dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    arch.check_parallelism(tp, pp)
    inputs = fingerprint_inputs([hf_dir])
    params = {"dtype": dtype, "tp": tp, "pp": pp}
    if is_up_to_date(out, STAGE, inputs, params):
        return ConvertResult(out, json.loads((out / "config.json").read_text()), True, 0.0, 0)
    check_output_free(out, force)

    start = time.perf_counter()
    return_freed_tensor_memory()
    weights = LazyWeights(hf_dir)
    check_source_tensors(weights, arch, hf_dir)
    config = checkpoint_config(arch, dtype, tp, pp)
    positions = [RankPosition(t, p, tp, pp) for p in range(pp) for t in range(tp)]
    jobs = {pos.rank: rank_jobs(arch, weights, pos, DTYPES[dtype]) for pos in positions}
    total = sum(spec.nbytes for rank_list in jobs.values() for spec, _ in rank_list)
    with atomic_output_dir(out) as tmp, _progress(progress) as bar:
        task = bar.add_task("convert", total=total)
        for rank, rank_list in sorted(jobs.items()):
            write_rank_file(tmp / f"rank{rank}.safetensors", rank_list, lambda n: bar.advance(task, n))
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        copy_tokenizer_files(hf_dir, tmp)
        write_manifest(tmp, STAGE, inputs, params, {"source": source.spec, "trtllm_version": TRTLLM_VERSION})
    return ConvertResult(out, config, False, time.perf_counter() - start, total)


def return_freed_tensor_memory() -> None:
    """Make glibc give each tensor-sized buffer back to the OS when it is freed.

    glibc raises its mmap threshold after large frees, so later tensor buffers come from the heap and
    stay resident after being freed; over a model's worth of tensors peak RSS grew to ~6x the largest
    tensor. Pinning the threshold at 1 MiB keeps peak RSS near one tensor (see bench_convert.py).
    """
    try:
        ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):  # not glibc: nothing to tune
        pass


def expected_source_shapes(arch: ModelArch) -> dict[str, tuple[int, ...]]:
    """Every tensor a Hugging Face Llama/Mistral of these dimensions must have, with its shape."""
    h, i = arch.hidden_size, arch.intermediate_size
    shapes = {"model.embed_tokens.weight": (arch.vocab_size, h), "model.norm.weight": (h,)}
    if not arch.tie_word_embeddings:
        shapes["lm_head.weight"] = (arch.vocab_size, h)
    for layer in range(arch.num_hidden_layers):
        p = f"model.layers.{layer}."
        linears = {"self_attn.q_proj": (arch.q_size, h), "self_attn.k_proj": (arch.kv_size, h),
                   "self_attn.v_proj": (arch.kv_size, h), "self_attn.o_proj": (h, arch.q_size),
                   "mlp.gate_proj": (i, h), "mlp.up_proj": (i, h), "mlp.down_proj": (h, i)}
        for name, shape in linears.items():
            shapes[p + name + ".weight"] = shape
            is_attn = name.startswith("self_attn")
            if (arch.attn_bias and is_attn) or (arch.mlp_bias and not is_attn):
                shapes[p + name + ".bias"] = shape[:1]
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
    return shapes


def check_source_tensors(weights: LazyWeights, arch: ModelArch, where: Path) -> None:
    """Every expected tensor present with the shape config.json implies, before any work is done."""
    expected = expected_source_shapes(arch)
    present = weights.names()
    missing = sorted(set(expected) - present)
    if missing:
        more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
        raise UserError(f"{where}: missing tensor(s) {', '.join(missing[:3])}{more}; "
                        "the weights are incomplete or do not belong to this config.json")
    for name, shape in expected.items():
        actual = weights.shape(name)
        if actual != shape:
            raise UserError(f"{where}: tensor {name} has shape {list(actual)} but config.json implies "
                            f"{list(shape)}; the weights and config.json disagree")


def checkpoint_config(arch: ModelArch, dtype: str, tp: int, pp: int) -> dict:
    """config.json of the checkpoint: the PretrainedConfig keys plus LLaMAConfig's own fields."""
    return {
        "producer": {"name": "trtpipe", "version": __version__},
        "architecture": arch.architecture,
        "dtype": dtype,
        "logits_dtype": "float32",
        "vocab_size": arch.vocab_size,
        "max_position_embeddings": arch.max_position_embeddings,
        "hidden_size": arch.hidden_size,
        "num_hidden_layers": arch.num_hidden_layers,
        "num_attention_heads": arch.num_attention_heads,
        "num_key_value_heads": arch.num_key_value_heads,
        "head_size": arch.head_size,
        "intermediate_size": arch.intermediate_size,
        "hidden_act": arch.hidden_act,
        "norm_epsilon": arch.norm_epsilon,
        "position_embedding_type": "rope_gpt_neox",
        "rotary_base": arch.rotary_base,
        "rotary_scaling": arch.rotary_scaling,
        "use_parallel_embedding": False,
        "embedding_sharding_dim": 0,
        "tie_word_embeddings": arch.tie_word_embeddings,
        "mapping": {"world_size": tp * pp, "tp_size": tp, "pp_size": pp},
        "quantization": {"quant_algo": None, "kv_cache_quant_algo": None},
        "mlp_bias": arch.mlp_bias,
        "attn_bias": arch.attn_bias,
        "residual_mlp": False,
        "disable_weight_only_quant_plugin": False,
        "fc_after_embed": False,
        "use_input_layernorm_in_first_layer": True,
        "use_last_layernorm": True,
        "layer_idx_offset": 0,
        "moe": {"num_experts": 0, "shared_expert_intermediate_size": 0, "top_k": 0,
                "normalization_mode": 1, "sparse_mixer_epsilon": 0.01, "tp_mode": 0},
        **({"sliding_window": arch.extra["sliding_window"]} if "sliding_window" in arch.extra else {}),
    }


Producer = Callable[[], "torch.Tensor | SourceRows | list[SourceRows]"]


def as_output(data, dtype: str) -> torch.Tensor | list[SourceRows]:
    """Source rows already in the output dtype are copied byte for byte; anything else is cast (only then
    is torch imported)."""
    if not isinstance(data, (SourceRows, list)):
        return data.to(torch_dtype(dtype))
    pieces = [data] if isinstance(data, SourceRows) else data
    if all(p.dtype == dtype for p in pieces):
        return pieces
    import torch

    return torch.cat([p.load().to(torch_dtype(dtype)) for p in pieces])


def rank_jobs(arch: ModelArch, weights: LazyWeights, pos: RankPosition,
              dtype: str) -> list[tuple[TensorSpec, Producer]]:
    """The tensors of one rank file, in write order, each with a function that reads and shapes it."""
    jobs: list[tuple[TensorSpec, Producer]] = []

    def add(name: str, shape: tuple[int, ...], produce: Producer) -> None:
        jobs.append((TensorSpec(name, dtype, shape), lambda: as_output(produce(), dtype)))

    tp, r = pos.tp_size, pos.tp_rank
    h = arch.hidden_size
    if pos.is_first_pp:
        add("transformer.vocab_embedding.weight", (arch.vocab_size, h),
            partial(weights.rows, "model.embed_tokens.weight"))
    def column_shard(name: str, size: int) -> Producer:
        if tp == 1:
            return partial(weights.rows, name)
        return partial(weights.read, name, None, _shard(size, tp, r))

    qkv = qkv_row_ranges(arch, tp, r)
    qkv_rows = sum(b - a for a, b in qkv.values())
    inter = arch.intermediate_size // tp
    for local, layer in enumerate(pos.layers(arch.num_hidden_layers)):
        src, dst = f"model.layers.{layer}.", f"transformer.layers.{local}."
        add(dst + "input_layernorm.weight", (h,), partial(weights.rows, src + "input_layernorm.weight"))
        add(dst + "attention.qkv.weight", (qkv_rows, h), partial(_read_qkv, weights, src, qkv, "weight"))
        if arch.attn_bias:
            add(dst + "attention.qkv.bias", (qkv_rows,), partial(_read_qkv, weights, src, qkv, "bias"))
        add(dst + "attention.dense.weight", (h, arch.q_size // tp),
            column_shard(src + "self_attn.o_proj.weight", arch.q_size))
        if arch.attn_bias:
            add(dst + "attention.dense.bias", (h,), partial(weights.rows, src + "self_attn.o_proj.bias"))
        add(dst + "post_layernorm.weight", (h,), partial(weights.rows, src + "post_attention_layernorm.weight"))
        for ours, theirs in (("fc", "gate_proj"), ("gate", "up_proj")):
            rows = _shard(arch.intermediate_size, tp, r)
            add(dst + f"mlp.{ours}.weight", (inter, h), partial(weights.rows, src + f"mlp.{theirs}.weight", rows))
            if arch.mlp_bias:
                add(dst + f"mlp.{ours}.bias", (inter,), partial(weights.rows, src + f"mlp.{theirs}.bias", rows))
        add(dst + "mlp.proj.weight", (h, inter),
            column_shard(src + "mlp.down_proj.weight", arch.intermediate_size))
        if arch.mlp_bias:
            add(dst + "mlp.proj.bias", (h,), partial(weights.rows, src + "mlp.down_proj.bias"))
    if pos.is_last_pp:
        add("transformer.ln_f.weight", (h,), partial(weights.rows, "model.norm.weight"))
        head = "model.embed_tokens.weight" if arch.tie_word_embeddings else "lm_head.weight"
        padded = -(-arch.vocab_size // tp) * tp
        add("lm_head.weight", (padded // tp, h), partial(_read_lm_head_shard, weights, head, arch.vocab_size,
                                                         padded, tp, r))
    return jobs


def qkv_row_ranges(arch: ModelArch, tp: int, r: int) -> dict[str, tuple[int, int]]:
    """Source rows of q, k and v that rank r holds; with tp > kv heads, rank r gets K/V head r*kv/tp."""
    hd, kv = arch.head_size, arch.num_key_value_heads
    ranges = {"q": _shard(arch.q_size, tp, r)}
    if kv >= tp:
        kv_rows = _shard(arch.kv_size, tp, r)
    else:
        head = r * kv // tp
        kv_rows = (head * hd, (head + 1) * hd)
    ranges["k"] = ranges["v"] = kv_rows
    return ranges


def _shard(size: int, tp: int, r: int) -> tuple[int, int]:
    part = size // tp
    return r * part, (r + 1) * part


def _read_qkv(weights: LazyWeights, src: str, ranges: dict, kind: str) -> list[SourceRows]:
    return [weights.rows(f"{src}self_attn.{x}_proj.{kind}", ranges[x]) for x in "qkv"]


def _read_lm_head_shard(weights: LazyWeights, name: str, vocab: int, padded: int, tp: int, r: int):
    start, end = _shard(padded, tp, r)
    if end <= vocab:
        return weights.rows(name, (start, end))
    import torch

    real = weights.read(name, (start, min(end, vocab))) if start < vocab else None
    pad = torch.zeros(end - max(start, vocab), weights.shape(name)[1], dtype=torch.float32)
    return pad if real is None else torch.cat([real.to(torch.float32), pad], dim=0)


def write_rank_file(path: Path, jobs: list[tuple[TensorSpec, Producer]], advance: Callable[[int], None]) -> None:
    with SafetensorsWriter(path, [spec for spec, _ in jobs], {"format": "pt"}) as writer:
        for spec, produce in jobs:
            writer.write(produce())
            advance(spec.nbytes)


#: what a Hugging Face tokenizer may consist of: copied beside the checkpoint, and by deploy into the repository
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "generation_config.json",
                   "chat_template.jinja")


def copy_tokenizer_files(hf_dir: Path, dest: Path) -> None:
    """Keep the tokenizer beside the checkpoint: deploy and validate need it, and it is small."""
    tok_dir = dest / "tokenizer"
    for name in TOKENIZER_FILES:
        if (hf_dir / name).is_file():
            tok_dir.mkdir(exist_ok=True)
            (tok_dir / name).write_bytes((hf_dir / name).read_bytes())


def _progress(enabled: bool) -> Progress:
    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), TransferSpeedColumn(),
                    TimeRemainingColumn(), disable=not enabled, transient=True)
