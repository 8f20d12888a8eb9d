"""The sparsify stage: float checkpoint + calibration data -> 2:4 float checkpoint with its claim.

One decoder layer at a time through the layer stream (the memory bound calibration has): a first pass of every
calibration sample collects E[x x^T] of each linear's input (fc and gate share theirs), the layer's linears are
pruned in place (SparseGPT, or magnitude without a pass), written, and a second pass pushes the samples through
the pruned layer, so the next layer is pruned on the inputs it will see (SparseGPT's sequential mode). The
output's config.json claims 2:4 for every decoder linear (`pattern.CONFIG_KEY`); the embedding and lm_head stay
dense. The held-out perplexity before and after goes into the manifest, and reading the output back for it
checks the pattern in every claimed weight.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..calibrate.data import CalibrationRecipe, load_texts, load_tokenizer, tokenize_samples
from ..calibrate.rounding import HessianStats, gptq_inverse
from ..calibrate.stage import EVAL_WINDOW, dataset_inputs, heldout_sequences
from ..checkpoint import CheckpointConfig
from ..checkpoint_writer import LayerwiseCheckpointWriter
from ..errors import UserError
from ..model.spec import ROW
from ..outputs import fingerprint_inputs, stage_output
from ..runtime.stream import LoadedLayer
from ..runtime.trtllm_reader import CheckpointReader, Layer, Linear
from .pattern import PATTERN, SparsityClaim, check_pattern_name, check_width
from .sparsegpt import DEFAULT_DAMP, DEFAULT_METHOD, METHODS, prune_magnitude, prune_sparsegpt

STAGE = "sparsify"


@dataclass(frozen=True)
class SparsifyOptions:
    recipe: CalibrationRecipe
    pattern: str = PATTERN
    method: str = DEFAULT_METHOD
    damp: float = DEFAULT_DAMP
    eval_samples: int = 40
    device: str = "auto"
    force: bool = False
    progress: bool = True

    def params(self) -> dict:
        sparsegpt = self.method == "sparsegpt"
        return {"pattern": self.pattern, "method": self.method, "damp": self.damp if sparsegpt else None,
                "recipe": self.recipe.to_dict() if sparsegpt else None, "eval_samples": self.eval_samples}


@dataclass(frozen=True)
class SparsifyResult:
    path: Path
    claim: SparsityClaim | None
    perplexity: dict | None          # {"dense": .., "sparse": .., "ratio": .., "tokens": ..}
    samples: int
    tokens: int
    seconds: float
    skipped: bool = False

    def to_dict(self) -> dict:
        claim = None if self.claim is None else {**self.claim.to_dict(), "modules": len(self.claim.modules)}
        return {"checkpoint": str(self.path), "skipped": self.skipped, "sparsity": claim,
                "samples": self.samples, "tokens": self.tokens, "seconds": round(self.seconds, 2),
                "perplexity": self.perplexity}

    def summary(self) -> str:
        if self.skipped:
            return f"sparse checkpoint {self.path} is up to date (inputs unchanged); nothing to do"
        c = self.claim
        lines = [f"{c.pattern} {c.method}: {len(c.modules)} decoder linears pruned (embedding and lm_head dense), "
                 f"{self.samples} samples, {self.tokens} tokens, {self.seconds:.0f} s"]
        if self.perplexity:
            p = self.perplexity
            lines.append(f"held-out perplexity: dense {p['dense']:.3f}, {c.pattern} {p['sparse']:.3f} "
                         f"({(p['ratio'] - 1) * 100:+.1f}%) over {p['tokens']} tokens")
        lines.append(f"wrote {self.path} (the {c.pattern} pattern checked in every claimed weight)")
        return "\n".join(lines)


def sparsify_checkpoint(checkpoint: Path, out: Path, options: SparsifyOptions) -> SparsifyResult:
    started = time.monotonic()
    checkpoint, out = Path(checkpoint), Path(out)
    cfg = check_input(checkpoint, options)
    sources = [checkpoint] + (dataset_inputs(options.recipe) if options.method == "sparsegpt" else [])
    with stage_output(out, STAGE, fingerprint_inputs(sources), options.params(), force=options.force) as output:
        if output.up_to_date:
            return SparsifyResult(out, CheckpointConfig.read(out).sparsity, None, 0, 0, 0.0, skipped=True)

        from ..runtime import LayerStream, perplexity, resolve_device

        device = resolve_device(options.device)
        needs_text = options.method == "sparsegpt" or options.eval_samples > 0
        tokenizer = load_tokenizer(checkpoint) if needs_text else None     # magnitude without eval reads no text
        samples = (tokenize_samples(load_texts(options.recipe), tokenizer, options.recipe)
                   if options.method == "sparsegpt" else [])
        heldout = heldout_sequences(tokenizer, options.eval_samples) if needs_text else []
        stream = LayerStream(checkpoint, device)
        dense = perplexity(stream, heldout, window=EVAL_WINDOW, progress=options.progress,
                           desc="perplexity (dense)") if heldout else None

        claim = SparsityClaim(options.pattern, options.method,
                              tuple(f"transformer.layers.{i}.{name}" for i in range(cfg.arch.num_hidden_layers)
                                    for name in cfg.family.linear_names))
        writer = LayerwiseCheckpointWriter(checkpoint, cfg, output.dir)
        pruner = LayerPruner(cfg, options, writer)
        if samples:
            stream.run_layers(samples, passes=pruner.passes, desc="sparsify" if options.progress else None)
        else:                      # magnitude: no statistics, no pass
            pruner.prune_without_data(stream)
        writer.close(cfg.with_sparsity(claim))
        if (checkpoint / "tokenizer").is_dir():
            shutil.copytree(checkpoint / "tokenizer", output.dir / "tokenizer")
        ppl = None
        if dense is not None:
            sparse = perplexity(LayerStream(output.dir, device), heldout, window=EVAL_WINDOW,
                                progress=options.progress, desc="perplexity (2:4)")
            ppl = {"dense": dense.perplexity, "sparse": sparse.perplexity,
                   "ratio": sparse.perplexity / dense.perplexity, "tokens": sparse.tokens}
        else:
            CheckpointReader(output.dir).check_every_layer()
        tokens = sum(len(s) for s in samples)
        seconds = time.monotonic() - started
        output.extra.update(sparsity={**claim.to_dict(), "layers": cfg.arch.num_hidden_layers}, perplexity=ppl,
                            samples=len(samples), tokens=tokens, seconds=round(seconds, 2))
    return SparsifyResult(out, claim, ppl, len(samples), tokens, seconds)


def check_input(checkpoint: Path, options: SparsifyOptions) -> CheckpointConfig:
    """Everything wrong with the request, before any output exists."""
    check_pattern_name(options.pattern)
    if options.method not in METHODS:
        raise UserError(f"--method must be one of {', '.join(METHODS)} (got {options.method!r})")
    if not options.damp > 0.0:
        raise UserError(f"--damp must be positive (got {options.damp})")
    cfg = CheckpointConfig.read(checkpoint)
    if cfg.is_quantized:
        raise UserError(f"{checkpoint} is quantized ({cfg.quant_algo or cfg.kv_cache_quant_algo}); sparsify the float "
                        "checkpoint `trtpipe convert` wrote, then calibrate the sparse one")
    if cfg.sparsity is not None:
        raise UserError(f"{checkpoint} is already {cfg.sparsity.pattern} sparse ({cfg.sparsity.method}); sparsify its "
                        "dense source instead")
    sizes_per_rank = {lin.name: _input_width(cfg, lin) for lin in cfg.family.linears}
    for name, width in sizes_per_rank.items():
        check_width(name, width)
    context = cfg.arch.max_position_embeddings
    if options.method == "sparsegpt" and context and options.recipe.seq_len > context:
        raise UserError(f"--seq-len {options.recipe.seq_len} is longer than the model's context "
                        f"(max_position_embeddings={context}); use at most {context}")
    return cfg


def _input_width(cfg: CheckpointConfig, lin) -> int:
    from ..model.spec import dims

    width = dims(cfg.arch)[lin.inputs]
    return width // cfg.layout.tp if lin.parallel == ROW else width


class LayerPruner:
    """The layer stream's passes for sparsify: statistics, then the layer pruned in place, written, and run."""

    def __init__(self, cfg: CheckpointConfig, options: SparsifyOptions, writer: LayerwiseCheckpointWriter):
        self.cfg, self.options, self.writer = cfg, options, writer

    def passes(self, loaded):
        family = self.cfg.family
        hessians: dict[str, HessianStats] = {}
        prefix = f"transformer.layers.{loaded.index}."
        if self.options.method == "sparsegpt":

            def observe(name: str, x: torch.Tensor) -> None:
                inner = name[len(prefix):]
                if inner in family.linear_names and family.input_source(inner) == inner:
                    hessians.setdefault(inner, HessianStats()).collect(x)

            yield observe
        inverses = {}
        for name in family.linear_names:
            weight = loaded.linear(name).weight
            if self.options.method == "magnitude":
                weight.copy_(prune_magnitude(weight))
                continue
            source = family.input_source(name)
            if source not in inverses:
                inverses[source] = _inverse(hessians.pop(source), self.options.damp, f"{prefix}{source}")
            weight.copy_(prune_sparsegpt(weight, inverses[source]))
        del inverses
        self.writer.write_layer(loaded.index, Layer({n: _plain(loaded.linear(n)) for n in family.linear_names},
                                                    loaded.layer.norms))
        yield None          # the pruned layer's outputs are the next layer's inputs


    def prune_without_data(self, stream) -> None:
        for i in range(self.cfg.arch.num_hidden_layers):
            for _ in self.passes(LoadedLayer(i, stream.reader.layer(i), None)):
                pass


def _inverse(stats: HessianStats, damp: float, module: str) -> torch.Tensor:
    hinv = gptq_inverse(stats.finish(), damp)
    if hinv is None:
        raise UserError(f"{module}: the calibration inputs' second moments are not finite or do not factorize even "
                        "with 1000x the damping; the checkpoint or the calibration text is broken")
    return hinv


def _plain(lin: Linear) -> Linear:
    return Linear(lin.weight, lin.bias)
