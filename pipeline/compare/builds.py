"""What `trtpipe compare` reads of a build directory (OUT of `trtpipe build`): its plan, its model repository,
the checkpoint it serves, and the identity of its model and tokenizer.

Two builds are comparable when they are the same model (architecture and every dimension the plan
records) with the same tokenizer (vocabulary, added tokens and special-token ids); a build quantized,
planned or batched differently is still the same model. Only then is perplexity per token, and the
agreement of generated tokens, comparable.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..errors import UserError, read_json_object
from ..model_repository import model_names
from ..plan.schema import SpeculativePlan
from ..tokenizer import tokenizer_fingerprint

#: The plan's model fields that name the model itself; dtype, quantization, paths and sharding do not.
MODEL_IDENTITY_FIELDS = ("architecture", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                         "num_attention_heads", "num_key_value_heads", "head_size", "hidden_act",
                         "tie_word_embeddings", "qkv_bias", "dense_bias", "mlp_bias", "qk_norm")


@dataclass(frozen=True)
class BuildInfo:
    """One build directory: where its parts are and what its plan says."""

    path: Path
    label: str                 # what reports call it: "<precision> (<directory name>)"
    plan: dict
    checkpoint: Path           # the checkpoint the repository serves (checkpoint-<precision>/ or checkpoint/)
    repo: Path
    tokenizer: Path

    @property
    def precision(self) -> str:
        return self.plan["precision"]

    @property
    def speculative(self) -> SpeculativePlan | None:
        """The plan's speculative decoding (None: the build does not speculate)."""
        spec = self.plan.get("speculative")
        return SpeculativePlan(**spec) if spec else None

    def model_identity(self) -> dict:
        return {k: self.plan["model"].get(k) for k in MODEL_IDENTITY_FIELDS}

    def memory(self) -> dict:
        """The plan's per-instance figures: weights, and the memory one instance is planned to hold."""
        memory = self.plan["memory"]
        planned = (memory["weights_bytes_per_rank"] + memory["activation_bytes"] + memory["runtime_reserve_bytes"]
                   + memory["kv_cache_bytes"])
        return {"weights_bytes": self.plan["weights_bytes"], "weights_bytes_per_rank": memory["weights_bytes_per_rank"],
                "kv_cache_bytes": memory["kv_cache_bytes"], "planned_bytes_per_instance": planned,
                "target": self.plan["target"]["name"], "target_memory_bytes": memory["memory_bytes"]}


def load_build(path: Path, side: str) -> BuildInfo:
    """The build directory `path` (`side` is "A" or "B", for the messages); a UserError naming what is missing."""
    path = Path(path).expanduser().resolve()
    hint = "pass the output directory of `trtpipe build` (it holds build.json, plan.json and model_repo/)"
    if not path.is_dir():
        raise UserError(f"build {side}: {path} is not a directory; {hint}")
    for part in ("build.json", "plan.json"):
        if not (path / part).is_file():
            raise UserError(f"build {side}: {path} has no {part}; {hint}")
    plan = read_json_object(path / "plan.json", f"build {side}: ")
    if not isinstance(plan.get("model"), dict) or "precision" not in plan or "memory" not in plan:
        raise UserError(f"build {side}: {path / 'plan.json'} is not a trtpipe plan (no model, precision or memory)")
    repo = path / "model_repo"
    if not model_names(repo):
        raise UserError(f"build {side}: {repo} holds no model; the build stopped before deploy "
                        "(rerun `trtpipe build`)")
    quantized = path / f"checkpoint-{plan['precision']}"
    checkpoint = quantized if quantized.is_dir() else path / "checkpoint"
    if not any(checkpoint.glob("rank*.safetensors")):
        raise UserError(f"build {side}: no checkpoint in {checkpoint} (perplexity is computed from it)")
    tokenizer = checkpoint / "tokenizer"
    if not tokenizer.is_dir():
        raise UserError(f"build {side}: {checkpoint} has no tokenizer/ directory")
    return BuildInfo(path, f"{plan['precision']} ({path.name})", plan, checkpoint, repo, tokenizer)


def identity_differences(a: BuildInfo, b: BuildInfo, tok_a, tok_b) -> list[str]:
    """What makes the two builds different models or tokenizers (empty: comparable)."""
    ia, ib = a.model_identity(), b.model_identity()
    diffs = [f"model {k}: {ia[k]!r} vs {ib[k]!r}" for k in MODEL_IDENTITY_FIELDS if ia[k] != ib[k]]
    if tokenizer_fingerprint(tok_a) != tokenizer_fingerprint(tok_b):
        diffs.append(f"tokenizer: {a.tokenizer} and {b.tokenizer} differ (vocabulary, added or special tokens)")
    return diffs
