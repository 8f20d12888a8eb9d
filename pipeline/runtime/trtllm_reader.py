"""Read a TensorRT-LLM checkpoint of any tp/pp layout back as float32 weights, whole or a layer at a time.

Every rank file is checked against the layout its model family declares (pipeline/model) before a
tensor is read: missing or unexpected tensors, wrong shapes and wrong dtypes are all reported by
rank file and tensor name. Merging undoes the sharding the spec describes: pipeline stages are
renumbered from local to global layer indices, column-parallel linears (and lm_head) are concatenated
on dim 0 and row-parallel ones on dim 1, duplicated K/V heads of the fused qkv (tp >
num_key_value_heads) are collapsed after checking that the copies agree, and vocab padding is cut.
Quantized weights are dequantized rank by rank with their own scales, so the merged float32 weight
is exactly the value the engine's GEMM sees.

`CheckpointReader` validates every rank file from the headers alone and then merges one piece at a
time (the embedding, one decoder layer, the final norm, a range of lm_head rows), reading only that
piece's bytes: the layer stream (`stream.py`) never holds more than one layer. `hf_checkpoint.load_checkpoint`
merges everything at once for the serving runtime.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ..checkpoint import LM_HEAD, LM_HEAD_WEIGHT, CheckpointConfig, RankFile, open_rank_files
from ..errors import UserError
from ..model.spec import QKV, ROW, LinearSpec, dims
from ..precisions import DTYPE_CODES, INT4_QUANT_ALGOS
from ..safetensors_stream import torch_dtype
from . import int4
from .config import read_config
from .quant import TensorQuant, dequantize_weight, fake_quant_fp8

FLOATS = (torch.float32, torch.float16, torch.bfloat16)
SCALAR = (1,)
MAX_PROBLEMS = 12
#: quant_algo -> the number format its GEMM quantizes activations to (None: float activations)
ACTIVATION_FORMAT = {"FP8": "fp8", "W8A8_SQ_PER_CHANNEL": "int8", **INT4_QUANT_ALGOS}


@dataclass
class Linear:
    """One linear layer as the engine computes it: y = quant(x * prequant) @ weight.T + bias."""

    weight: torch.Tensor                       # float32 [out, in], dequantized
    bias: torch.Tensor | None = None
    act_quant: TensorQuant | None = None       # activation quantizer (FP8 or INT8 per-tensor)
    prequant: torch.Tensor | None = None       # SmoothQuant per-input-channel smoothing [in]


@dataclass
class Layer:
    """One merged decoder layer: its linears and norms by TensorRT-LLM name (`attention.qkv`,
    `input_layernorm`, ...), as the family's spec lists them."""

    linears: dict[str, Linear]
    norms: dict[str, torch.Tensor]
    kv_quant: TensorQuant | None = None


@dataclass
class ModelWeights:
    embedding: torch.Tensor                    # [vocab, hidden]
    layers: list[Layer]
    final_norm: torch.Tensor
    lm_head: torch.Tensor                      # [vocab, hidden]


@dataclass(frozen=True)
class Expect:
    shape: tuple[int, ...]
    dtypes: tuple[torch.dtype, ...]
    required: bool = True
    note: str = ""          # what the shape means, added to a wrong-shape problem


class CheckpointReader:
    """A validated checkpoint whose merged float32 pieces are read on demand (nothing is held)."""

    def __init__(self, ckpt_dir: Path):
        self.path = Path(ckpt_dir)
        self.cfg = read_config(self.path)
        self.ranks = open_rank_files(self.path, self.cfg)
        problems = []
        for rf in self.ranks:
            problems += check_rank(rf, expected_tensors(self.cfg, rf))
        report(self.path, problems)
        self._stages = [[rf for rf in self.ranks if rf.pp_rank == s] for s in range(self.cfg.layout.pp)]

    @property
    def num_layers(self) -> int:
        return self.cfg.arch.num_hidden_layers

    def embedding(self, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """The float32 embedding [vocab, hidden], or only the given range of vocabulary rows."""
        return merge_embedding(self.cfg, self._stages[0], rows)

    def layer(self, index: int) -> Layer:
        stage = self._stages[index // self.cfg.layout.layers_per_stage]
        return merge_layer(self.cfg, stage, index - stage[0].layer_offset, index)

    def final_norm(self) -> torch.Tensor:
        return self._stages[-1][0].read("transformer.ln_f.weight").float()

    @property
    def tied_lm_head(self) -> bool:
        return LM_HEAD_WEIGHT not in self.head_stage[0].names()

    @property
    def head_stage(self) -> list[RankFile]:
        """The rank files of the last pipeline stage (ln_f and lm_head), in tp order."""
        return self._stages[-1]

    def lm_head(self, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """The float32 lm_head [vocab, hidden] (the embedding when tied), or only a range of its rows; a 4-bit
        lm_head dequantized with its AWQ smoothing folded in (x @ (W * pqs)^T = (x * pqs) @ W^T)."""
        if self.tied_lm_head:
            return self.embedding(rows)
        start, stop = rows or (0, self.cfg.arch.vocab_size)
        if self.cfg.quantized_lm_head:
            return torch.cat(quantized_head_rows(self.cfg, self.head_stage, start, stop))
        return torch.cat([part.float() for part in _vocab_shards(self.head_stage, LM_HEAD_WEIGHT, start, stop)])

    def merge_all(self) -> ModelWeights:
        return merge_pieces(self)

    def check_every_layer(self) -> int:
        """Read every decoder layer once, so each claimed weight is checked (`check_sparsity`) and every weight is
        finite; the number of layers read."""
        for i in range(self.num_layers):
            self.layer(i)
        return self.num_layers


def merge_pieces(reader) -> ModelWeights:
    """Every piece of a reader (`CheckpointReader`, or `HfCheckpointReader` for a Hugging Face checkpoint)."""
    embedding = reader.embedding()
    return ModelWeights(embedding, [reader.layer(i) for i in range(reader.num_layers)], reader.final_norm(),
                        embedding if reader.tied_lm_head else reader.lm_head())


def expected_tensors(cfg: CheckpointConfig, rf: RankFile) -> dict[str, Expect]:
    """Every tensor this rank file must (or may) hold, with its shape and allowed dtypes."""
    arch, family, pos = cfg.arch, cfg.family, rf.position
    dt = (torch_dtype(DTYPE_CODES[cfg.dtype]),)
    h, v, tp = arch.hidden_size, arch.vocab_size, cfg.layout.tp
    shard_vocab = -(-v // tp)
    sizes = dims(arch)
    out: dict[str, Expect] = {}
    if pos.is_first_pp:
        emb = (v, h)
        if cfg.use_parallel_embedding and tp > 1:
            emb = (shard_vocab, h) if cfg.embedding_sharding_dim == 0 else (v, h // tp)
        out["transformer.vocab_embedding.weight"] = Expect(emb, dt)
    if pos.is_last_pp:
        out["transformer.ln_f.weight"] = Expect((h,), dt)
        if cfg.quantized_lm_head:
            out.update(int4.expected_linear(cfg, LM_HEAD, LM_HEAD, shard_vocab, h, Expect))
        else:
            out[LM_HEAD_WEIGHT] = Expect((shard_vocab, h), dt, required=not cfg.share_embedding_table)
    for local in range(cfg.layout.layers_per_stage):
        p, g = f"transformer.layers.{local}.", f"transformer.layers.{pos.layers[local]}."
        for norm in family.layer_norms(arch):
            out[p + norm.name + ".weight"] = Expect((sizes[norm.size],), dt)
        for lin in family.linears:
            o, i = pos.linear_shape(arch, lin)
            out.update(expected_linear(cfg, p + lin.name, g + lin.name, family.has_bias(lin, arch), o, i, dt))
        if cfg.kv_cache_quant_algo:
            out[p + "attention.kv_cache_scaling_factor"] = Expect(SCALAR, FLOATS)
            for kind in "kv":   # modelopt also writes the separate K and V factors (informational)
                out[p + f"attention.{kind}_cache_scaling_factor"] = Expect(SCALAR, FLOATS, required=False)
    return out


def expected_linear(cfg: CheckpointConfig, local: str, module: str, has_bias: bool, o: int, i: int,
                    dt: tuple[torch.dtype, ...]) -> dict[str, Expect]:
    out = {}
    if has_bias:
        out[local + ".bias"] = Expect((o,), dt)
    if not cfg.quantizes(module):
        out[local + ".weight"] = Expect((o, i), dt)
        return out
    if cfg.quant_algo in INT4_QUANT_ALGOS:
        out.update(int4.expected_linear(cfg, local, module, o, i, Expect))
        return out
    if cfg.quant_algo == "FP8":
        out[local + ".weight"] = Expect((o, i), (torch.float8_e4m3fn,))
        out[local + ".weights_scaling_factor"] = Expect(SCALAR, FLOATS)
    else:  # W8A8_SQ_PER_CHANNEL
        out[local + ".weight"] = Expect((o, i), (torch.int8,))
        out[local + ".weights_scaling_factor"] = Expect((o,), FLOATS)
        out[local + ".prequant_scaling_factor"] = Expect((i,), FLOATS)
    out[local + ".activation_scaling_factor"] = Expect(SCALAR, FLOATS)
    return out


def check_rank(rf: RankFile, expected: dict[str, Expect]) -> list[str]:
    return check_tensors(rf.path.name, rf.file, expected)


def check_tensors(where: str, tensors, expected: dict[str, Expect]) -> list[str]:
    """Problems of the tensors `tensors` holds (names(), shape(name), dtype_code(name)) against `expected`."""
    problems = []
    present = tensors.names()
    for name in sorted(set(expected) - present):
        if expected[name].required:
            problems.append(f"{where}: missing tensor {name}")
    for name in sorted(present - set(expected)):
        problems.append(f"{where}: unexpected tensor {name}")
    for name in sorted(present & set(expected)):
        exp = expected[name]
        shape = tensors.shape(name)
        dtype = torch_dtype(tensors.dtype_code(name))
        ok_shape = shape == exp.shape or (exp.shape == SCALAR and shape in ((), (1,)))
        if not ok_shape:
            note = f" ({exp.note})" if exp.note else ""
            problems.append(f"{where}: tensor {name} has shape {list(shape)}, expected {list(exp.shape)}{note}")
        if dtype not in exp.dtypes:
            allowed = "/".join(str(d).removeprefix("torch.") for d in exp.dtypes)
            problems.append(f"{where}: tensor {name} has dtype {tensors.dtype_code(name)}, expected {allowed}")
    return problems


def report(ckpt_dir: Path, problems: list[str], what: str = "checkpoint {} does not match its config.json") -> None:
    if not problems:
        return
    shown = problems[:MAX_PROBLEMS]
    more = f"\n  ... and {len(problems) - len(shown)} more" if len(problems) > len(shown) else ""
    raise UserError(what.format(ckpt_dir) + f" ({len(problems)} problem(s)):\n  " + "\n  ".join(shown) + more)


# ---------------------------------------------------------------- merging


def merge_embedding(cfg: CheckpointConfig, stage: list[RankFile],
                    rows: tuple[int, int] | None = None) -> torch.Tensor:
    name = "transformer.vocab_embedding.weight"
    start, stop = rows or (0, cfg.arch.vocab_size)
    if not (cfg.use_parallel_embedding and cfg.layout.tp > 1):
        return stage[0].read(name, (start, stop)).float()
    if cfg.embedding_sharding_dim == 0:
        return torch.cat([part.float() for part in _vocab_shards(stage, name, start, stop)])
    return torch.cat([rf.read(name, (start, stop)).float() for rf in stage], dim=1)


def _vocab_shards(stage: list[RankFile], name: str, start: int, stop: int) -> list[torch.Tensor]:
    """Rows start..stop of a tensor split over the tp ranks by vocabulary rows (padding rows never read)."""
    shard = stage[0].file.shape(name)[0]
    parts = []
    for rf in stage:
        lo, hi = max(start, rf.tp_rank * shard), min(stop, (rf.tp_rank + 1) * shard)
        if lo < hi:
            parts.append(rf.read(name, (lo - rf.tp_rank * shard, hi - rf.tp_rank * shard)))
    return parts


def quantized_head_rows(cfg: CheckpointConfig, stage: list[RankFile], start: int, stop: int) -> list[torch.Tensor]:
    """Rows start..stop of a 4-bit lm_head, float32, each tp shard's codes times its group scales times the
    smoothing, reading only the bytes of those rows (codes are packed in pairs of rows)."""
    if INT4_QUANT_ALGOS[cfg.quant_algo]:
        raise UserError(f"a {cfg.quant_algo} lm_head (FP8 activations) is not read by trtpipe: calibrate with "
                        "--precision int4-awq to quantize lm_head")
    shard = stage[0].file.shape(LM_HEAD + ".weights_scaling_factor")[0]
    parts = []
    for rf in stage:
        offset = rf.tp_rank * shard
        lo, hi = max(start - offset, 0), min(stop - offset, shard)
        if lo >= hi:
            continue
        first = lo - lo % 2
        codes = int4.unpack_int4(rf.read(LM_HEAD_WEIGHT, (first // 2, (hi + 1) // 2)))[lo - first:hi - first]
        weight = int4.dequantize_groupwise(codes, int4.read_scale_rows(rf, LM_HEAD + ".weights_scaling_factor",
                                                                       (lo, hi)))
        if int4.has_prequant(cfg):
            weight = weight * int4.read_scale(rf, LM_HEAD + ".prequant_scaling_factor")[None, :]
        parts.append(weight)
    return parts


def merge_layer(cfg: CheckpointConfig, stage: list[RankFile], local: int, layer: int) -> Layer:
    p, g = f"transformer.layers.{local}.", f"transformer.layers.{layer}."
    family = cfg.family
    linears = {lin.name: merge_linear(cfg, lin, stage, p + lin.name, g + lin.name) for lin in family.linears}
    if cfg.quant_algo == "FP8":
        for lin in family.linears:
            partner = lin.fused_with
            if partner and lin.name < partner and cfg.quantizes(g + lin.name) and cfg.quantizes(g + partner):
                fuse_fp8_pair(stage, p, lin.name, partner, linears)
    kv_quant = None
    if cfg.kv_cache_quant_algo:
        scale = same_on_all_ranks(stage, p + "attention.kv_cache_scaling_factor", g + "attention")
        kv_quant = TensorQuant(cfg.kv_cache_quant_algo.lower(), float(scale.reshape(-1)[0]))
    norms = {n.name: stage[0].read(p + n.name + ".weight").float() for n in family.layer_norms(cfg.arch)}
    check_sparsity(cfg, stage[0].path.parent, g, linears)
    check_finite({**{f"{g}{name}.weight": lin.weight for name, lin in linears.items()},
                  **{f"{g}{name}.bias": lin.bias for name, lin in linears.items() if lin.bias is not None},
                  **{f"{g}{name}.weight": norm for name, norm in norms.items()}})
    return Layer(linears, norms, kv_quant)


def check_sparsity(cfg: CheckpointConfig, ckpt_dir: Path, prefix: str, linears: dict[str, Linear]) -> None:
    """A checkpoint that claims 2:4 holds it in every claimed weight, read as the engine's GEMM sees it."""
    claim = cfg.sparsity
    if claim is None:
        return
    from ..sparsity.pattern import check_claimed

    for name, lin in linears.items():
        if claim.covers(prefix + name):
            check_claimed(prefix + name, lin.weight, claim, str(ckpt_dir))


def check_finite(tensors: dict[str, torch.Tensor]) -> None:
    """A NaN or infinite weight makes every output NaN (calibrate reported "perplexity nan" with exit 0): refuse
    it by name where the runtime first reads it."""
    for name, tensor in tensors.items():
        if not bool(torch.isfinite(tensor).all()):
            bad = int((~torch.isfinite(tensor)).sum())
            raise UserError(f"{name} holds {bad} NaN or infinite value(s): the checkpoint is corrupt (convert it "
                            "again from an intact source)")


def merge_linear(cfg: CheckpointConfig, lin: LinearSpec, stage: list[RankFile], local: str, module: str) -> Linear:
    quantized = cfg.quantizes(module)
    weights = [read_weight(cfg, rf, local, quantized) for rf in stage]
    biases = [rf.maybe(local + ".bias") for rf in stage]
    row = lin.parallel == ROW
    weight = merge_weights(cfg, lin, weights, module)
    bias = None
    if biases[0] is not None:
        bias = biases[0].float() if row else merge_weights(cfg, lin, [b.float() for b in biases], module)
    result = Linear(weight, bias)
    if quantized:
        if cfg.quant_algo in INT4_QUANT_ALGOS:
            int4.check_input_scales(cfg, stage, local)
        kind = ACTIVATION_FORMAT[cfg.quant_algo]
        if kind is not None:
            act = same_on_all_ranks(stage, local + ".activation_scaling_factor", module)
            result.act_quant = TensorQuant(kind, float(act.reshape(-1)[0]))
        if smooths(cfg):
            pre = [rf.read(local + ".prequant_scaling_factor").float() for rf in stage]
            result.prequant = (torch.cat(pre) if row
                               else same_on_all_ranks(stage, local + ".prequant_scaling_factor", module))
    return result


def smooths(cfg: CheckpointConfig) -> bool:
    """Whether the quantized linears scale their input per channel first (`prequant_scaling_factor`)."""
    return cfg.quant_algo == "W8A8_SQ_PER_CHANNEL" or (cfg.quant_algo in INT4_QUANT_ALGOS and int4.has_prequant(cfg))


def read_weight(cfg: CheckpointConfig, rf: RankFile, local: str, quantized: bool) -> torch.Tensor:
    """One rank's share of a linear's weight in float32, dequantized with its own scales."""
    if quantized and cfg.quant_algo in INT4_QUANT_ALGOS:
        return int4.read_weight(cfg, rf, local)
    return dequantize_weight(rf.read(local + ".weight"),
                             rf.read(local + ".weights_scaling_factor") if quantized else None)


def merge_weights(cfg: CheckpointConfig, lin: LinearSpec, per_rank: list[torch.Tensor], module: str) -> torch.Tensor:
    """The whole-model tensor from the tp ranks' shares of a linear's weight (or a column-parallel bias, or any
    tensor laid out like them): the inverse of `Rank.linear_part`."""
    if lin.parallel == QKV:
        return merge_qkv(cfg, per_rank, module)
    return torch.cat(per_rank, dim=1 if lin.parallel == ROW else 0)


def fuse_fp8_pair(stage: list[RankFile], prefix: str, a: str, b: str, linears: dict[str, Linear]) -> None:
    """The FP8 engine runs a fused pair (mlp.fc and mlp.gate) as one GEMM (PluginConfig.use_fused_mlp, on).

    TensorRT-LLM's `fuse_gate_mlp` dequantizes both weights, requantizes them with the larger of the two
    weight scales and quantizes the input with the larger activation scale; each tp rank does this on
    its own shards. A no-op when the two scales already agree (as nvidia-modelopt writes them).
    """
    parts: dict[str, list[torch.Tensor]] = {a: [], b: []}
    for rf in stage:
        ws = max(float(rf.read(prefix + n + ".weights_scaling_factor").reshape(-1)[0]) for n in (a, b))
        for name in (a, b):
            w = dequantize_weight(rf.read(prefix + name + ".weight"),
                                  rf.read(prefix + name + ".weights_scaling_factor"))
            parts[name].append(fake_quant_fp8(w, ws))
    scale = max(linears[a].act_quant.scale, linears[b].act_quant.scale)
    for name in (a, b):
        linears[name].weight = torch.cat(parts[name])
        linears[name].act_quant = TensorQuant("fp8", scale)


def merge_qkv(cfg: CheckpointConfig, per_rank: list[torch.Tensor], module: str) -> torch.Tensor:
    """Undo the per-rank cat(q, k, v) layout and the duplication of K/V heads."""
    hd, tp, kv = cfg.arch.head_size, cfg.layout.tp, cfg.arch.num_key_value_heads
    q_rows, kv_rows = cfg.q_heads_per_rank * hd, cfg.kv_heads_per_rank * hd
    parts = [torch.split(t, [q_rows, kv_rows, kv_rows], dim=0) for t in per_rank]
    q = torch.cat([p[0] for p in parts])
    reps = max(tp // kv, 1)
    k, v = [], []
    for r in range(0, tp, reps):
        for dup in range(r + 1, r + reps):
            for idx, kind in ((1, "K"), (2, "V")):
                if not torch.allclose(parts[dup][idx], parts[r][idx], rtol=1e-5, atol=1e-8):
                    raise UserError(f"{module}: tp ranks {r} and {dup} must hold the same duplicated {kind} head "
                                    f"(tp_size {tp} > num_key_value_heads {kv}) but differ")
        k.append(parts[r][1])
        v.append(parts[r][2])
    return torch.cat([q, torch.cat(k), torch.cat(v)])


def same_on_all_ranks(stage: list[RankFile], name: str, module: str) -> torch.Tensor:
    values = [rf.read(name).float() for rf in stage]
    for rf, value in zip(stage[1:], values[1:]):
        if not torch.equal(value.reshape(-1), values[0].reshape(-1)):
            raise UserError(f"{module}: {name.rsplit('.', 1)[-1]} differs between {stage[0].path.name} and "
                            f"{rf.path.name}; the reference runtime needs one value for all tp ranks")
    return values[0].reshape(-1)
