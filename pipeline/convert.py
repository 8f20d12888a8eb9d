"""The convert stage: Hugging Face weights -> TensorRT-LLM 1.2.x unified checkpoint, for any family in
the registry (pipeline/model).

The family's spec says which Hugging Face tensors make each TensorRT-LLM tensor and how it is split
(docs/model-families.md §6, as TensorRT-LLM's own converters write them): q/k/v fused in Q,K,V order
into `attention.qkv`, `gate_proj -> mlp.fc`, `up_proj -> mlp.gate`, `down_proj -> mlp.proj`;
column-parallel linears split on dim 0, row-parallel ones on dim 1; K/V heads duplicated when tp >
num_kv_heads; norms replicated; lm_head padded to a multiple of tp; each pipeline rank holds its
contiguous layers (named with local indices), the embedding on the first and ln_f/lm_head on the last.
Tensors are read slice by slice from the memory-mapped source and each rank file is streamed to disk,
so peak memory follows the largest tensor, not the model.
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

from . import TRTLLM_VERSION
from .arch import ModelArch
from .checkpoint import CheckpointConfig
from .errors import UserError
from .model.layout import Rank, padded_vocab, shard
from .model import family_of
from .model.arch_config import hf_tensor_shapes
from .model.spec import HF_LAYER, ROW, TRT_LAYER, LinearSpec, dims
from .precisions import CHECKPOINT_DTYPES, DTYPE_CODES
from .outputs import fingerprint_inputs, stage_output
from .safetensors_stream import LazyWeights, SafetensorsWriter, SourceRows, TensorSpec, torch_dtype
from .sources import ModelSource, read_hf_arch
from .tokenizer import copy_tokenizer_files

if TYPE_CHECKING:
    import torch

STAGE = "convert"


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
    config = CheckpointConfig.new(arch, dtype or arch.dtype, tp, pp)
    dtype = config.dtype
    inputs = fingerprint_inputs([hf_dir])
    params = {"dtype": dtype, "tp": tp, "pp": pp}
    extra = {"source": source.reference, "trtllm_version": TRTLLM_VERSION}
    with stage_output(out, STAGE, inputs, params, force=force, extra=extra) as output:
        if output.up_to_date:
            return ConvertResult(out, json.loads((out / "config.json").read_text()), True, 0.0, 0)
        start = time.perf_counter()
        return_freed_tensor_memory()
        weights = LazyWeights(hf_dir)
        check_source_tensors(weights, arch, hf_dir)
        jobs = {pos.rank: rank_jobs(arch, weights, pos, DTYPE_CODES[dtype]) for pos in config.layout.ranks}
        total = sum(spec.nbytes for rank_list in jobs.values() for spec, _ in rank_list)
        with _progress(progress) as bar:
            task = bar.add_task("convert", total=total)
            for rank, rank_list in sorted(jobs.items()):
                write_rank_file(output.dir / f"rank{rank}.safetensors", rank_list, lambda n: bar.advance(task, n))
        config.write(output.dir)
        copy_tokenizer_files(hf_dir, output.dir)
    return ConvertResult(out, config.to_dict(), False, time.perf_counter() - start, total)


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


def check_source_tensors(weights: LazyWeights, arch: ModelArch, where: Path) -> None:
    """Every expected tensor present with the shape config.json implies, and nothing the family does not
    use (a bias or norm the converter would silently drop), before any work is done."""
    expected = hf_tensor_shapes(arch)
    present = weights.names()
    missing = sorted(set(expected) - present)
    if missing:
        raise UserError(f"{where}: missing tensor(s) {_some(missing)}; "
                        "the weights are incomplete or do not belong to this config.json")
    family = family_of(arch.architecture)
    ignored = {family.lm_head[0]} if arch.tie_word_embeddings else set()   # a saved copy of the tied table
    unexpected = sorted(n for n in present - set(expected) - ignored if not n.endswith(family.ignored_sources))
    if unexpected:
        raise UserError(f"{where}: unexpected tensor(s) {_some(unexpected)} that a {arch.architecture} with this "
                        "config.json does not have; converting would drop them (is config.json for these weights?)")
    for name, shape in expected.items():
        actual = weights.shape(name)
        if actual != shape:
            raise UserError(f"{where}: tensor {name} has shape {list(actual)} but config.json implies "
                            f"{list(shape)}; the weights and config.json disagree")
        if weights.dtype_code(name) not in FLOAT_SOURCE_CODES:
            raise UserError(f"{where}: tensor {name} is {weights.dtype_code(name)}, not a floating-point dtype "
                            f"({', '.join(FLOAT_SOURCE_CODES)}); casting it would invent weights (was it quantized "
                            "by another tool? convert its original float checkpoint)")


#: the safetensors dtypes a Hugging Face model's float weights may have: those of a float checkpoint
FLOAT_SOURCE_CODES = tuple(DTYPE_CODES[dtype] for dtype in CHECKPOINT_DTYPES)


def _some(names: list[str]) -> str:
    more = f" (and {len(names) - 3} more)" if len(names) > 3 else ""
    return ", ".join(names[:3]) + more


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


def rank_jobs(arch: ModelArch, weights: LazyWeights, pos: Rank, dtype: str) -> list[tuple[TensorSpec, Producer]]:
    """The tensors of one rank file, in write order, each with a function that reads and shapes it."""
    jobs: list[tuple[TensorSpec, Producer]] = []

    def add(name: str, shape: tuple[int, ...], produce: Producer) -> None:
        jobs.append((TensorSpec(name, dtype, shape), lambda: as_output(produce(), dtype)))

    family, sizes = family_of(arch.architecture), dims(arch)
    h = arch.hidden_size
    if pos.is_first_pp:
        hf, trt = family.embedding
        add(trt, (arch.vocab_size, h), partial(weights.rows, hf))
    for local, layer in enumerate(pos.layers):
        src, dst = HF_LAYER.format(layer), TRT_LAYER.format(local)
        for norm in family.layer_norms(arch):
            add(dst + norm.name + ".weight", (sizes[norm.size],), partial(weights.rows, src + norm.hf + ".weight"))
        for lin in family.linears:
            shape = pos.linear_shape(arch, lin)
            add(dst + lin.name + ".weight", shape, linear_shard(weights, pos, arch, lin, src, "weight"))
            if family.has_bias(lin, arch):
                add(dst + lin.name + ".bias", shape[:1], linear_shard(weights, pos, arch, lin, src, "bias"))
    if pos.is_last_pp:
        hf, trt = family.final_norm
        add(trt, (h,), partial(weights.rows, hf))
        head = family.embedding[0] if arch.tie_word_embeddings else family.lm_head[0]
        tp, padded = pos.tp_size, padded_vocab(arch.vocab_size, pos.tp_size)
        add(family.lm_head[1], (padded // tp, h),
            partial(_read_lm_head_shard, weights, head, arch.vocab_size, padded, tp, pos.tp_rank))
    return jobs


def linear_shard(weights: LazyWeights, pos: Rank, arch: ModelArch, lin: LinearSpec, src: str, kind: str) -> Producer:
    """Reads this rank's share of a linear's weight or bias: the rows of each fused part (column, qkv),
    or the input columns (row-parallel weight; a row-parallel bias is whole on every rank)."""
    names = [src + part.hf + "." + kind for part in lin.parts]
    if lin.parallel == ROW:
        if kind == "bias" or pos.tp_size == 1:
            return partial(weights.rows, names[0])
        return partial(weights.read, names[0], None, shard(dims(arch)[lin.inputs], pos.tp_size, pos.tp_rank))
    reads = [partial(weights.rows, name, pos.part_rows(arch, part)) for name, part in zip(names, lin.parts)]
    if len(reads) == 1:
        return reads[0]
    return lambda: [read() for read in reads]


def _read_lm_head_shard(weights: LazyWeights, name: str, vocab: int, padded: int, tp: int, r: int):
    start, end = shard(padded, tp, r)
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


def _progress(enabled: bool) -> Progress:
    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), TransferSpeedColumn(),
                    TimeRemainingColumn(), disable=not enabled, transient=True)
