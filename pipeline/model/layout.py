"""How a model is laid out over tp x pp GPUs: which ranks exist, which layers each holds, which rows and
columns of each tensor a rank keeps. The one place the parallelism rules live (convert, calibrate, the
runtime and plan all ask here).

TensorRT-LLM's Mapping: rank = pp_rank * tp_size + tp_rank. Attention heads and the MLP split over tp
(K/V heads are split, or duplicated when tp exceeds them); trtpipe gives every pipeline stage the same
number of decoder layers (TensorRT-LLM 1.2's `Mapping.pp_layers` would give the first stages one more
when pp does not divide the layers; trtpipe refuses that layout instead of writing a lopsided one).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import UserError
from .spec import ROW, LinearSpec, Part, dims

if TYPE_CHECKING:
    from ..arch import ModelArch


def check_parallelism(arch: "ModelArch", tp: int, pp: int, tp_name: str = "--tp", pp_name: str = "--pp") -> None:
    """UserError unless this model can be sharded tp x pp (the names say where the numbers came from)."""
    if tp < 1 or pp < 1:
        raise UserError(f"{tp_name} and {pp_name} must be positive (got tp={tp}, pp={pp})")
    if arch.num_attention_heads % tp:
        raise UserError(f"{tp_name} {tp} does not divide num_attention_heads {arch.num_attention_heads}")
    kv = arch.num_key_value_heads
    if (kv >= tp and kv % tp) or (kv < tp and tp % kv):
        raise UserError(f"{tp_name} {tp} and num_key_value_heads {kv}: one must be a multiple of the other "
                        "(K/V heads are split, or duplicated when tp > num_key_value_heads)")
    if arch.num_hidden_layers % pp:
        raise UserError(f"{pp_name} {pp} does not divide num_hidden_layers {arch.num_hidden_layers}")
    if arch.intermediate_size % tp:
        raise UserError(f"{tp_name} {tp} does not divide intermediate_size {arch.intermediate_size}")


def shard(size: int, tp: int, r: int) -> tuple[int, int]:
    """The contiguous block [start, stop) of `size` rows (or columns) that tp rank r holds."""
    part = size // tp
    return r * part, (r + 1) * part


def kv_heads_per_rank(num_kv_heads: int, tp: int) -> int:
    """K/V heads a tp rank holds: its share, or one duplicated head when tp > num_kv_heads."""
    return max(num_kv_heads // tp, 1)


def padded_vocab(vocab_size: int, tp: int) -> int:
    """lm_head rows after zero-padding to a multiple of tp (vocab-parallel)."""
    return -(-vocab_size // tp) * tp


@dataclass(frozen=True)
class Rank:
    """One GPU of the tp x pp mapping, and the global decoder layers it holds."""

    tp_rank: int
    pp_rank: int
    tp_size: int
    pp_size: int
    layers: range

    @property
    def rank(self) -> int:
        return self.pp_rank * self.tp_size + self.tp_rank

    @property
    def file_name(self) -> str:
        return f"rank{self.rank}.safetensors"

    @property
    def is_first_pp(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_pp(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def part_rows(self, arch: "ModelArch", part: Part) -> tuple[int, int]:
        """Rows of one HF source of a column or qkv linear that this rank holds (a duplicated K/V head when
        tp > num_key_value_heads: rank r gets head r * kv_heads // tp)."""
        tp, r = self.tp_size, self.tp_rank
        if part.rows != "kv":
            return shard(dims(arch)[part.rows], tp, r)
        kv, hd = arch.num_key_value_heads, arch.head_size
        if kv >= tp:
            return shard(arch.kv_size, tp, r)
        head = r * kv // tp
        return head * hd, (head + 1) * hd

    def linear_part(self, arch: "ModelArch", lin: LinearSpec, merged, kind: str = "weight"):
        """This rank's share of a merged (whole-model) linear weight [out, in] or bias [out]: the inverse of
        the reader's merge. Row-parallel: its block of input columns (a bias is whole on every rank);
        otherwise its rows of each fused part, in the spec's part order (a duplicated K/V head included)."""
        if lin.parallel == ROW:
            return merged if kind == "bias" else merged[:, slice(*shard(merged.shape[1], self.tp_size, self.tp_rank))]
        sizes, offset, pieces = dims(arch), 0, []
        for part in lin.parts:
            start, stop = self.part_rows(arch, part)
            pieces.append(merged[offset + start:offset + stop])
            offset += sizes[part.rows]
        if len(pieces) == 1:
            return pieces[0]
        import torch

        return torch.cat(pieces)

    def linear_shape(self, arch: "ModelArch", lin: LinearSpec) -> tuple[int, int]:
        """[out, in] of a linear on this rank."""
        sizes = dims(arch)
        if lin.parallel == ROW:
            return lin.out_features(sizes), sizes[lin.inputs] // self.tp_size
        return sum(b - a for a, b in (self.part_rows(arch, p) for p in lin.parts)), sizes[lin.inputs]


@dataclass(frozen=True)
class RankLayout:
    """The ranks of a tp x pp checkpoint of `num_layers` decoder layers."""

    tp: int
    pp: int
    num_layers: int

    @classmethod
    def for_arch(cls, arch: "ModelArch", tp: int, pp: int, **names: str) -> "RankLayout":
        check_parallelism(arch, tp, pp, **names)
        return cls(tp, pp, arch.num_hidden_layers)

    @property
    def world_size(self) -> int:
        return self.tp * self.pp

    @property
    def layers_per_stage(self) -> int:
        return self.num_layers // self.pp

    def stage_layers(self, pp_rank: int) -> range:
        n = self.layers_per_stage
        return range(pp_rank * n, (pp_rank + 1) * n)

    def rank(self, rank: int) -> Rank:
        tp_rank, pp_rank = rank % self.tp, rank // self.tp
        return Rank(tp_rank, pp_rank, self.tp, self.pp, self.stage_layers(pp_rank))

    @property
    def ranks(self) -> list[Rank]:
        return [self.rank(r) for r in range(self.world_size)]

    def mapping(self) -> dict:
        return {"world_size": self.world_size, "tp_size": self.tp, "pp_size": self.pp}
