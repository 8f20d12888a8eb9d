"""Read a TensorRT-LLM checkpoint of any tp/pp layout back as float32 weights, whole or a layer at a time.

Every rank file is checked against the layout TensorRT-LLM defines (upstream-facts A1) before a
tensor is read: missing or unexpected tensors, wrong shapes and wrong dtypes are all reported by
rank file and tensor name. Merging undoes the sharding: pipeline stages are renumbered from local to
global layer indices, column-parallel linears (qkv, mlp.fc, mlp.gate, lm_head) are concatenated on
dim 0 and row-parallel ones (attention.dense, mlp.proj) on dim 1, duplicated K/V heads (tp >
num_key_value_heads) are collapsed after checking that the copies agree, and vocab padding is cut.
Quantized weights are dequantized rank by rank with their own scales, so the merged float32 weight
is exactly the value the engine's GEMM sees.

`CheckpointReader` validates every rank file from the headers alone and then merges one piece at a
time (the embedding, one decoder layer, the final norm, a range of lm_head rows), reading only that
piece's bytes: the layer stream (`stream.py`) never holds more than one layer. `load_checkpoint`
merges everything at once for the serving runtime.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from fnmatch import fnmatch
from pathlib import Path

import torch

from ..errors import UserError
from ..safetensors_stream import SafetensorsFile, torch_dtype
from .config import RuntimeConfig, read_config
from .quant import TensorQuant, dequantize_weight, fake_quant_fp8

MODEL_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
FLOATS = (torch.float32, torch.float16, torch.bfloat16)
SCALAR = (1,)
COLUMN = ("attention.qkv", "mlp.fc", "mlp.gate")
ROW = ("attention.dense", "mlp.proj")
LAYER_NAME = re.compile(r"^transformer\.layers\.(\d+)\.")
MAX_PROBLEMS = 12


@dataclass
class Linear:
    """One linear layer as the engine computes it: y = quant(x * prequant) @ weight.T + bias."""

    weight: torch.Tensor                       # float32 [out, in], dequantized
    bias: torch.Tensor | None = None
    act_quant: TensorQuant | None = None       # activation quantizer (FP8 or INT8 per-tensor)
    prequant: torch.Tensor | None = None       # SmoothQuant per-input-channel smoothing [in]


@dataclass
class Layer:
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: Linear
    dense: Linear
    fc: Linear
    gate: Linear
    proj: Linear
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


@dataclass
class RankFile:
    rank: int
    tp_rank: int
    pp_rank: int
    path: Path
    file: SafetensorsFile = field(repr=False)

    def names(self) -> set[str]:
        return self.file.names()

    def get(self, name: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        return self.file.read(name, rows)

    def maybe(self, name: str) -> torch.Tensor | None:
        return self.get(name) if name in self.file.names() else None


class CheckpointReader:
    """A validated checkpoint whose merged float32 pieces are read on demand (nothing is held)."""

    def __init__(self, ckpt_dir: Path):
        self.path = Path(ckpt_dir)
        self.config, self.cfg = read_config(self.path)
        self.ranks = open_rank_files(self.path, self.cfg)
        self.stage_layers = layers_per_stage(self.ranks, self.cfg)
        problems = []
        for rf in self.ranks:
            problems += check_rank(rf, expected_tensors(self.cfg, rf, self.stage_layers))
        report(self.path, problems)
        self._stages = [[rf for rf in self.ranks if rf.pp_rank == s] for s in range(self.cfg.pp_size)]

    @property
    def num_layers(self) -> int:
        return self.cfg.num_layers

    def embedding(self, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """The float32 embedding [vocab, hidden], or only the given range of vocabulary rows."""
        return merge_embedding(self.cfg, self._stages[0], rows)

    def layer(self, index: int) -> Layer:
        stage = next(s for s in range(self.cfg.pp_size) if index < first_layer(self.stage_layers, s + 1))
        return merge_layer(self.cfg, self._stages[stage], index - first_layer(self.stage_layers, stage), index)

    def final_norm(self) -> torch.Tensor:
        return self._stages[-1][0].get("transformer.ln_f.weight").float()

    @property
    def tied_lm_head(self) -> bool:
        return "lm_head.weight" not in self._stages[-1][0].names()

    def lm_head(self, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """The float32 lm_head [vocab, hidden] (the embedding when tied), or only a range of its rows."""
        if self.tied_lm_head:
            return self.embedding(rows)
        start, stop = rows or (0, self.cfg.vocab_size)
        return torch.cat([part.float() for part in _vocab_shards(self._stages[-1], "lm_head.weight", start, stop)])

    def merge_all(self) -> ModelWeights:
        embedding = self.embedding()
        return ModelWeights(embedding, [self.layer(i) for i in range(self.num_layers)], self.final_norm(),
                            embedding if self.tied_lm_head else self.lm_head())


def load_checkpoint(ckpt_dir: Path) -> tuple[dict, RuntimeConfig, ModelWeights]:
    """Read, validate and merge a checkpoint; UserError (naming every problem) if it is not runnable."""
    reader = CheckpointReader(ckpt_dir)
    return reader.config, reader.cfg, reader.merge_all()


def open_rank_files(ckpt_dir: Path, cfg: RuntimeConfig) -> list[RankFile]:
    world = cfg.tp_size * cfg.pp_size
    missing = [f"rank{r}.safetensors" for r in range(world) if not (ckpt_dir / f"rank{r}.safetensors").is_file()]
    if missing:
        raise UserError(f"{ckpt_dir}: missing {', '.join(missing)} (config.json maps tp={cfg.tp_size} x "
                        f"pp={cfg.pp_size} = {world} ranks)")
    expected = {f"rank{r}.safetensors" for r in range(world)}
    extra = sorted(p.name for p in ckpt_dir.glob("rank*.safetensors") if p.name not in expected)
    if extra:
        raise UserError(f"{ckpt_dir}: unexpected {', '.join(extra)} for a {world}-rank checkpoint "
                        f"(config.json mapping tp={cfg.tp_size} pp={cfg.pp_size})")
    files = []
    for r in range(world):
        path = ckpt_dir / f"rank{r}.safetensors"
        files.append(RankFile(r, r % cfg.tp_size, r // cfg.tp_size, path, SafetensorsFile(path)))
    return files


def layers_per_stage(ranks: list[RankFile], cfg: RuntimeConfig) -> list[int]:
    """How many layers each pipeline stage holds, read from the local layer indices in its files."""
    counts = []
    for stage in range(cfg.pp_size):
        found = {int(m.group(1)) for rf in ranks if rf.pp_rank == stage
                 for m in map(LAYER_NAME.match, rf.names()) if m}
        n = max(found) + 1 if found else 0
        if found != set(range(n)):
            raise UserError(f"pipeline stage {stage}: layer indices {sorted(found)} are not 0..{n - 1}; "
                            "each stage must name its layers with contiguous local indices")
        counts.append(n)
    if sum(counts) != cfg.num_layers:
        raise UserError(f"the rank files hold {sum(counts)} layers ({' + '.join(map(str, counts))} over "
                        f"{cfg.pp_size} pipeline stages) but config.json says num_hidden_layers={cfg.num_layers}")
    return counts


def first_layer(stage_layers: list[int], pp_rank: int) -> int:
    return sum(stage_layers[:pp_rank])


def is_quantized(cfg: RuntimeConfig, module: str) -> bool:
    if cfg.quant_algo is None:
        return False
    return not any(fnmatch(module, pat) or module.endswith("." + pat) for pat in cfg.exclude_modules)


def linear_shapes(cfg: RuntimeConfig) -> dict[str, tuple[int, int]]:
    """[out, in] of each linear on one tp rank."""
    tp, h, hd = cfg.tp_size, cfg.hidden_size, cfg.head_size
    qkv_out = (cfg.q_heads_per_rank + 2 * cfg.kv_heads_per_rank) * hd
    inter = cfg.intermediate_size // tp
    return {"attention.qkv": (qkv_out, h), "attention.dense": (h, cfg.q_heads_per_rank * hd),
            "mlp.fc": (inter, h), "mlp.gate": (inter, h), "mlp.proj": (h, inter)}


def expected_tensors(cfg: RuntimeConfig, rf: RankFile, stage_layers: list[int]) -> dict[str, Expect]:
    """Every tensor this rank file must (or may) hold, with its shape and allowed dtypes."""
    dt = (MODEL_DTYPES[cfg.dtype],)
    h, v, tp = cfg.hidden_size, cfg.vocab_size, cfg.tp_size
    shard_vocab = -(-v // tp)
    out: dict[str, Expect] = {}
    if rf.pp_rank == 0:
        emb = (v, h)
        if cfg.use_parallel_embedding and tp > 1:
            emb = (shard_vocab, h) if cfg.embedding_sharding_dim == 0 else (v, h // tp)
        out["transformer.vocab_embedding.weight"] = Expect(emb, dt)
    if rf.pp_rank == cfg.pp_size - 1:
        out["transformer.ln_f.weight"] = Expect((h,), dt)
        out["lm_head.weight"] = Expect((shard_vocab, h), dt, required=not cfg.share_embedding_table)
    offset = first_layer(stage_layers, rf.pp_rank)
    for local in range(stage_layers[rf.pp_rank]):
        p = f"transformer.layers.{local}."
        out[p + "input_layernorm.weight"] = Expect((h,), dt)
        out[p + "post_layernorm.weight"] = Expect((h,), dt)
        for name, (o, i) in linear_shapes(cfg).items():
            out.update(expected_linear(cfg, p + name, f"transformer.layers.{offset + local}.{name}", o, i, dt))
        if cfg.kv_cache_quant_algo:
            out[p + "attention.kv_cache_scaling_factor"] = Expect(SCALAR, FLOATS)
            for kind in "kv":   # modelopt also writes the separate K and V factors (informational)
                out[p + f"attention.{kind}_cache_scaling_factor"] = Expect(SCALAR, FLOATS, required=False)
    return out


def expected_linear(cfg: RuntimeConfig, local: str, module: str, o: int, i: int,
                    dt: tuple[torch.dtype, ...]) -> dict[str, Expect]:
    has_bias = cfg.attn_bias if ".attention." in local else cfg.mlp_bias
    out = {}
    if has_bias:
        out[local + ".bias"] = Expect((o,), dt)
    if not is_quantized(cfg, module):
        out[local + ".weight"] = Expect((o, i), dt)
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
    problems = []
    present = rf.names()
    where = rf.path.name
    for name in sorted(set(expected) - present):
        if expected[name].required:
            problems.append(f"{where}: missing tensor {name}")
    for name in sorted(present - set(expected)):
        problems.append(f"{where}: unexpected tensor {name}")
    for name in sorted(present & set(expected)):
        exp = expected[name]
        shape = rf.file.shape(name)
        dtype = torch_dtype(rf.file.dtype_code(name))
        ok_shape = shape == exp.shape or (exp.shape == SCALAR and shape in ((), (1,)))
        if not ok_shape:
            problems.append(f"{where}: tensor {name} has shape {list(shape)}, expected {list(exp.shape)}")
        if dtype not in exp.dtypes:
            allowed = "/".join(str(d).removeprefix("torch.") for d in exp.dtypes)
            problems.append(f"{where}: tensor {name} has dtype {rf.file.dtype_code(name)}, expected {allowed}")
    return problems


def report(ckpt_dir: Path, problems: list[str]) -> None:
    if not problems:
        return
    shown = problems[:MAX_PROBLEMS]
    more = f"\n  ... and {len(problems) - len(shown)} more" if len(problems) > len(shown) else ""
    raise UserError(f"checkpoint {ckpt_dir} does not match its config.json "
                    f"({len(problems)} problem(s)):\n  " + "\n  ".join(shown) + more)


# ---------------------------------------------------------------- merging


def merge_embedding(cfg: RuntimeConfig, stage: list[RankFile], rows: tuple[int, int] | None = None) -> torch.Tensor:
    name = "transformer.vocab_embedding.weight"
    start, stop = rows or (0, cfg.vocab_size)
    if not (cfg.use_parallel_embedding and cfg.tp_size > 1):
        return stage[0].get(name, (start, stop)).float()
    if cfg.embedding_sharding_dim == 0:
        return torch.cat([part.float() for part in _vocab_shards(stage, name, start, stop)])
    return torch.cat([rf.get(name, (start, stop)).float() for rf in stage], dim=1)


def _vocab_shards(stage: list[RankFile], name: str, start: int, stop: int) -> list[torch.Tensor]:
    """Rows start..stop of a tensor split over the tp ranks by vocabulary rows (padding rows never read)."""
    shard = stage[0].file.shape(name)[0]
    parts = []
    for rf in stage:
        lo, hi = max(start, rf.tp_rank * shard), min(stop, (rf.tp_rank + 1) * shard)
        if lo < hi:
            parts.append(rf.get(name, (lo - rf.tp_rank * shard, hi - rf.tp_rank * shard)))
    return parts


def merge_layer(cfg: RuntimeConfig, stage: list[RankFile], local: int, layer: int) -> Layer:
    p = f"transformer.layers.{local}."
    g = f"transformer.layers.{layer}."
    linears = {name: merge_linear(cfg, stage, p + name, g + name) for name in COLUMN + ROW}
    if cfg.quant_algo == "FP8" and is_quantized(cfg, g + "mlp.fc") and is_quantized(cfg, g + "mlp.gate"):
        fuse_fp8_gate_mlp(stage, p + "mlp.", linears["mlp.fc"], linears["mlp.gate"])
    kv_quant = None
    if cfg.kv_cache_quant_algo:
        scale = same_on_all_ranks(stage, p + "attention.kv_cache_scaling_factor", g + "attention")
        kv_quant = TensorQuant(cfg.kv_cache_quant_algo.lower(), float(scale.reshape(-1)[0]))
    return Layer(input_norm=stage[0].get(p + "input_layernorm.weight").float(),
                 post_norm=stage[0].get(p + "post_layernorm.weight").float(),
                 qkv=linears["attention.qkv"], dense=linears["attention.dense"],
                 fc=linears["mlp.fc"], gate=linears["mlp.gate"], proj=linears["mlp.proj"], kv_quant=kv_quant)


def merge_linear(cfg: RuntimeConfig, stage: list[RankFile], local: str, module: str) -> Linear:
    quantized = is_quantized(cfg, module)
    weights = [dequantize_weight(rf.get(local + ".weight"),
                                 rf.get(local + ".weights_scaling_factor") if quantized else None) for rf in stage]
    biases = [rf.maybe(local + ".bias") for rf in stage]
    row = local.endswith(ROW)
    if local.endswith("attention.qkv"):
        weight = merge_qkv(cfg, weights, module)
        bias = merge_qkv(cfg, [b.float() for b in biases], module) if biases[0] is not None else None
    else:
        weight = torch.cat(weights, dim=1 if row else 0)
        bias = None
        if biases[0] is not None:
            bias = biases[0].float() if row else torch.cat([b.float() for b in biases])
    lin = Linear(weight, bias)
    if quantized:
        kind = "fp8" if cfg.quant_algo == "FP8" else "int8"
        act = same_on_all_ranks(stage, local + ".activation_scaling_factor", module)
        lin.act_quant = TensorQuant(kind, float(act.reshape(-1)[0]))
        if cfg.quant_algo == "W8A8_SQ_PER_CHANNEL":
            pre = [rf.get(local + ".prequant_scaling_factor").float() for rf in stage]
            lin.prequant = (torch.cat(pre) if row
                            else same_on_all_ranks(stage, local + ".prequant_scaling_factor", module))
    return lin


def fuse_fp8_gate_mlp(stage: list[RankFile], prefix: str, fc: Linear, gate: Linear) -> None:
    """The FP8 engine runs mlp.fc and mlp.gate as one GEMM (PluginConfig.use_fused_mlp, default on).

    TensorRT-LLM's `fuse_gate_mlp` dequantizes both weights, requantizes them with the larger of the two
    weight scales and quantizes the input with the larger activation scale; each tp rank does this on
    its own shards. A no-op when the two scales already agree (as nvidia-modelopt writes them).
    """
    fc_parts, gate_parts = [], []
    for rf in stage:
        ws = max(float(rf.get(prefix + n + ".weights_scaling_factor").reshape(-1)[0]) for n in ("fc", "gate"))
        for name, parts in (("fc", fc_parts), ("gate", gate_parts)):
            w = dequantize_weight(rf.get(prefix + name + ".weight"), rf.get(prefix + name + ".weights_scaling_factor"))
            parts.append(fake_quant_fp8(w, ws))
    fc.weight, gate.weight = torch.cat(fc_parts), torch.cat(gate_parts)
    fc.act_quant = gate.act_quant = TensorQuant("fp8", max(fc.act_quant.scale, gate.act_quant.scale))


def merge_qkv(cfg: RuntimeConfig, per_rank: list[torch.Tensor], module: str) -> torch.Tensor:
    """Undo the per-rank cat(q, k, v) layout and the duplication of K/V heads."""
    hd = cfg.head_size
    q_rows, kv_rows = cfg.q_heads_per_rank * hd, cfg.kv_heads_per_rank * hd
    parts = [torch.split(t, [q_rows, kv_rows, kv_rows], dim=0) for t in per_rank]
    q = torch.cat([p[0] for p in parts])
    reps = max(cfg.tp_size // cfg.num_kv_heads, 1)
    k, v = [], []
    for r in range(0, cfg.tp_size, reps):
        for dup in range(r + 1, r + reps):
            for idx, kind in ((1, "K"), (2, "V")):
                if not torch.allclose(parts[dup][idx], parts[r][idx], rtol=1e-5, atol=1e-8):
                    raise UserError(f"{module}: tp ranks {r} and {dup} must hold the same duplicated {kind} head "
                                    f"(tp_size {cfg.tp_size} > num_key_value_heads {cfg.num_kv_heads}) but differ")
        k.append(parts[r][1])
        v.append(parts[r][2])
    return torch.cat([q, torch.cat(k), torch.cat(v)])


def same_on_all_ranks(stage: list[RankFile], name: str, module: str) -> torch.Tensor:
    values = [rf.get(name).float() for rf in stage]
    for rf, value in zip(stage[1:], values[1:]):
        if not torch.equal(value.reshape(-1), values[0].reshape(-1)):
            raise UserError(f"{module}: {name.rsplit('.', 1)[-1]} differs between {stage[0].path.name} and "
                            f"{rf.path.name}; the reference runtime needs one value for all tp ranks")
    return values[0].reshape(-1)
