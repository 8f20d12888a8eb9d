"""The distill stage: a compressed student learns the float teacher's next-token distributions back.

Forward KL(teacher || student) on the logits of every position, on the calibration recipe's text (packed into
windows of --seq-len tokens, documents in a seeded order, cycled) and never on the held-out documents the report
scores. AdamW with a short warm-up and a cosine decay over the budget (tokens, or minutes of training). The
student's 2:4 masks and quantization scales stay fixed (`network`). The output is the student's checkpoint format
with the trained weights; OUT/distill holds the report and the loss curve.
"""

from __future__ import annotations

import json
import math
import resource
import shutil
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from ..calibrate.data import CalibrationRecipe, load_texts, load_tokenizer
from ..calibrate.stage import EVAL_WINDOW, dataset_inputs, heldout_sequences
from ..checkpoint import CheckpointConfig
from ..checkpoint_writer import LayerwiseCheckpointWriter
from ..errors import UserError
from ..outputs import fingerprint_inputs, stage_output
from ..runtime.trtllm_reader import Layer, Linear

STAGE = "distill"
REPORT_DIR = "distill"
#: peak learning rates, measured on SmolLM2-135M (docs/sparsity.md): a 2:4 student at 3e-4 recovered 69% of its
#: loss in 15 minutes; a dense quantized student starts close to the teacher and trains at 1e-4
SPARSE_LR = 3e-4
QUANTIZED_LR = 1e-4
DEFAULT_BATCH = 4
WARMUP_STEPS = 5
#: the learning rate decays to this fraction of its peak by the end of the budget
FINAL_LR = 0.1


@dataclass(frozen=True)
class DistillOptions:
    teacher: Path
    recipe: CalibrationRecipe
    tokens: int | None = None
    minutes: float | None = None
    lr: float | None = None         # None: SPARSE_LR for a 2:4 student, else QUANTIZED_LR
    batch: int = DEFAULT_BATCH
    recompute: bool = True          # recompute each layer's activations in the backward pass (memory)
    bf16: bool = True               # matmuls in bfloat16 (autocast); master weights, optimizer and loss in float32
    eval_samples: int = 40
    force: bool = False
    progress: bool = True

    def params(self) -> dict:
        return {"tokens": self.tokens, "minutes": self.minutes, "lr": self.lr, "batch": self.batch, "bf16": self.bf16,
                "recipe": self.recipe.to_dict(), "eval_samples": self.eval_samples}


@dataclass(frozen=True)
class DistillResult:
    path: Path
    perplexity: dict | None         # {"teacher": .., "before": .., "after": .., "tokens": ..}
    tokens_seen: int
    steps: int
    seconds: float
    peak_rss_gb: float
    qat: bool
    skipped: bool = False

    def to_dict(self) -> dict:
        return {"checkpoint": str(self.path), "skipped": self.skipped, "tokens_seen": self.tokens_seen,
                "steps": self.steps, "seconds": round(self.seconds, 2), "peak_rss_gb": round(self.peak_rss_gb, 2),
                "quantization_aware": self.qat, "perplexity": self.perplexity,
                "report": str(self.path / REPORT_DIR / "report.json")}

    def summary(self) -> str:
        if self.skipped:
            return f"distilled checkpoint {self.path} is up to date (inputs unchanged); nothing to do"
        lines = [f"distilled {self.tokens_seen} tokens in {self.steps} steps, {self.seconds:.0f} s "
                 f"({'quantization-aware, through the checkpoint''s quantizers' if self.qat else 'float'}), "
                 f"peak RSS {self.peak_rss_gb:.2f} GB"]
        if self.perplexity:
            p = self.perplexity
            lines.append(f"held-out perplexity: teacher {p['teacher']:.3f}, student before {p['before']:.3f} "
                         f"({(p['before'] / p['teacher'] - 1) * 100:+.1f}%), after {p['after']:.3f} "
                         f"({(p['after'] / p['teacher'] - 1) * 100:+.1f}%) over {p['tokens']} tokens")
        lines.append(f"wrote {self.path} (loss curve: {self.path / REPORT_DIR / 'loss.png'})")
        return "\n".join(lines)


def distill_checkpoint(student: Path, out: Path, options: DistillOptions) -> DistillResult:
    started = time.monotonic()
    student, out = Path(student), Path(out)
    cfg = check_request(student, options)
    if options.lr is None:
        options = replace(options, lr=SPARSE_LR if cfg.sparsity is not None else QUANTIZED_LR)
    inputs = fingerprint_inputs([student, Path(options.teacher)] + dataset_inputs(options.recipe))
    with stage_output(out, STAGE, inputs, options.params(), force=options.force) as output:
        if output.up_to_date:
            return DistillResult(out, None, 0, 0, 0.0, 0.0, cfg.is_quantized, skipped=True)
        from ..runtime import LayerStream, perplexity
        from .network import load_network

        tokenizer = load_tokenizer(student)
        windows = training_windows(load_texts(options.recipe), tokenizer, options.recipe)
        heldout = heldout_sequences(tokenizer, options.eval_samples)
        scored = {}
        if heldout:
            for name, path in (("teacher", Path(options.teacher)), ("before", student)):
                scored[name] = perplexity(LayerStream(path), heldout, window=EVAL_WINDOW, progress=options.progress,
                                          desc=f"perplexity ({name})")
        teacher = load_network(options.teacher, trainable=False)
        net = load_network(student, trainable=True)
        curve = train(net, teacher, windows, options)
        del teacher
        write_student(student, cfg, net, output.dir)
        shutil.copytree(student / "tokenizer", output.dir / "tokenizer")
        del net
        ppl = None
        if heldout:
            after = perplexity(LayerStream(output.dir), heldout, window=EVAL_WINDOW, progress=options.progress,
                               desc="perplexity (after)")
            ppl = {"teacher": scored["teacher"].perplexity, "before": scored["before"].perplexity,
                   "after": after.perplexity, "tokens": after.tokens}
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20
        seconds = time.monotonic() - started
        record = {"perplexity": ppl, "tokens_seen": curve.tokens[-1], "steps": len(curve.loss),
                  "seconds": round(seconds, 2), "train_seconds": round(curve.seconds, 2), "peak_rss_gb": round(peak, 2),
                  "quantization_aware": cfg.is_quantized, "sparsity": None if cfg.sparsity is None else
                  cfg.sparsity.pattern, "lr": options.lr, "batch": options.batch, "seq_len": options.recipe.seq_len,
                  "bf16": options.bf16}
        write_report(output.dir / REPORT_DIR, record, curve)
        output.extra.update(distill=record)
    return DistillResult(out, ppl, curve.tokens[-1], len(curve.loss), seconds, peak, cfg.is_quantized)


def check_request(student: Path, options: DistillOptions) -> CheckpointConfig:
    """Everything wrong with the request, before anything is read or written."""
    if (options.tokens is None) == (options.minutes is None):
        raise UserError("give the budget as one of --tokens N or --minutes M")
    if options.tokens is not None and options.tokens <= 0:
        raise UserError(f"--tokens must be positive (got {options.tokens})")
    if options.minutes is not None and not options.minutes > 0:
        raise UserError(f"--minutes must be positive (got {options.minutes})")
    if (options.lr is not None and not options.lr > 0) or options.batch < 1:
        raise UserError(f"--lr must be positive and --batch at least 1 (got {options.lr}, {options.batch})")
    cfg = CheckpointConfig.read(student)
    if not cfg.is_quantized and cfg.sparsity is None:
        raise UserError(f"{student} is dense and float: distill recovers what compression cost, and there is nothing "
                        "to recover; sparsify (2:4) or calibrate it first")
    teacher = CheckpointConfig.read(Path(options.teacher))
    if Path(options.teacher).resolve() == student.resolve():
        raise UserError("--teacher is the student itself; give the float model the student was compressed from")
    if teacher.is_quantized or teacher.sparsity is not None:
        how = teacher.quant_algo or teacher.kv_cache_quant_algo or teacher.sparsity.pattern
        raise UserError(f"--teacher {options.teacher} is compressed ({how}); the teacher "
                        "is the float dense model the student was made from (the output of `trtpipe convert`)")
    if teacher.arch != cfg.arch:
        differ = [k for k, v in vars(cfg.arch).items() if getattr(teacher.arch, k, None) != v]
        raise UserError(f"--teacher {options.teacher} is another architecture than the student (they differ in "
                        f"{', '.join(differ[:4])}); the teacher is the float model the student was compressed from")
    if load_tokenizer(student).get_vocab() != load_tokenizer(Path(options.teacher)).get_vocab():
        raise UserError(f"--teacher {options.teacher} has another tokenizer than the student: the KL on logits needs "
                        "the same vocabulary; use the float model the student was compressed from")
    return cfg


def training_windows(texts: list[str], tokenizer, recipe: CalibrationRecipe) -> list[list[int]]:
    """The recipe's texts in a seeded order, each ended with EOS, concatenated and cut into windows of seq_len
    tokens (the last partial window dropped); at most recipe.samples windows when it is set."""
    order = np.random.default_rng(recipe.seed).permutation(len(texts))
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    stream = [t for k in order for t in tokenizer(texts[k])["input_ids"] + eos]
    n = recipe.seq_len
    windows = [stream[i:i + n] for i in range(0, len(stream) - n + 1, n)]
    if recipe.samples:
        windows = windows[:recipe.samples]
    if not windows:
        raise UserError(f"calibration dataset {recipe.dataset} holds fewer than --seq-len {n} tokens")
    return windows


@dataclass
class LossCurve:
    tokens: list[int]
    loss: list[float]
    seconds: float = 0.0


def train(net, teacher, windows: list[list[int]], options: DistillOptions) -> LossCurve:
    from tqdm import tqdm

    from .network import kl_to_teacher, teacher_log_probs

    params = net.parameters()
    optimizer = torch.optim.AdamW(params, lr=options.lr, weight_decay=0.0)
    rng = np.random.default_rng(options.recipe.seed)
    order, cursor = rng.permutation(len(windows)), 0
    curve = LossCurve([0], [])
    started = time.monotonic()
    total = options.tokens if options.tokens is not None else int(options.minutes * 60)
    with tqdm(total=total, unit="tok" if options.tokens else "s", desc="distill", disable=not options.progress,
              leave=False) as bar:
        while (done := progress_of(options, curve.tokens[-1], time.monotonic() - started)) < 1.0:
            picks = []
            while len(picks) < options.batch:
                if cursor == len(order):
                    order, cursor = rng.permutation(len(windows)), 0
                picks.append(windows[order[cursor]])
                cursor += 1
            ids = torch.tensor(picks)
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(options.lr, len(curve.loss), done)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=options.bf16):
                target = teacher_log_probs(teacher, ids)
                hidden = net.hidden(ids, recompute=options.recompute)
                loss = kl_to_teacher(hidden.reshape(-1, hidden.shape[-1]), net.lm_head, target)
            loss.backward()
            net.keep_masks(grads=True)
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            net.keep_masks(grads=False)
            curve.loss.append(float(loss.detach()))
            curve.tokens.append(curve.tokens[-1] + ids.numel())
            bar.update(ids.numel() if options.tokens else 0)
            bar.set_postfix(loss=f"{curve.loss[-1]:.4f}")
    curve.tokens = curve.tokens[1:]
    curve.seconds = time.monotonic() - started
    return curve


def progress_of(options: DistillOptions, tokens: int, seconds: float) -> float:
    """How much of the budget is spent, 0..1."""
    if options.tokens is not None:
        return tokens / options.tokens
    return seconds / (options.minutes * 60)


def learning_rate(peak: float, step: int, done: float) -> float:
    """Linear warm-up over WARMUP_STEPS, then a cosine from the peak down to FINAL_LR of it at the budget's end."""
    warm = min(1.0, (step + 1) / WARMUP_STEPS)
    return peak * warm * (FINAL_LR + (1 - FINAL_LR) * 0.5 * (1 + math.cos(math.pi * min(done, 1.0))))


def write_student(source: Path, cfg: CheckpointConfig, net, out: Path) -> None:
    writer = LayerwiseCheckpointWriter(source, cfg, out)
    for i, layer in enumerate(net.layers):
        linears = {name: Linear(lin.weight.detach(), None if lin.bias is None else lin.bias.detach())
                   for name, lin in layer.linears.items()}
        writer.write_layer(i, Layer(linears, {name: norm.detach() for name, norm in layer.norms.items()}))
    writer.close(cfg)


def write_report(directory: Path, record: dict, curve: LossCurve) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory.mkdir()
    (directory / "report.json").write_text(json.dumps({**record, "loss_curve": {"tokens": curve.tokens,
                                                                                "kl": curve.loss}}, indent=2) + "\n")
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(curve.tokens, curve.loss, color="tab:blue", linewidth=1)
    ax.set_xlabel("training tokens seen")
    ax.set_ylabel("KL(teacher || student), nats per token")
    ppl = record.get("perplexity")
    title = "distillation loss"
    if ppl:
        title += f": held-out perplexity {ppl['before']:.2f} -> {ppl['after']:.2f} (teacher {ppl['teacher']:.2f})"
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(directory / "loss.png", dpi=80)
    plt.close(fig)
