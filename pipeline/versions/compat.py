"""Whether a build can become another version of a repository's `tensorrt_llm`, and why not.

A version is only a directory: everything else in a Triton repository is per model, shared by every version.
So a second build fits only when

- its backend keeps the weights inside the version directory: the reference backends (cpu: the Python model
  resolves `checkpoint/` and `onnx/` relative to its own version directory). The engine backend names its
  engine in the model-level parameter `gpt_model_path`, so two engines cannot be two versions; the llmapi
  layout names `tensorrt_llm/1` in repository-level files (model.yaml's model, trtllm-serve.sh);
- it is the same model with the same tokenizer (the preprocessing and postprocessing models, and their
  tokenizer, serve every version);
- every config.pbtxt is the same ModelConfig message apart from tensorrt_llm's version_policy: batching,
  request contract, parameters (max_seq_len, the runtime, ...) are the model's, not the version's.

`refusal` returns the one message that says what differs (None when the build fits).
"""

from __future__ import annotations

from pathlib import Path

from ..backends import backend_for
from ..backends.names import INFLIGHT_BATCHER
from ..errors import UserError
from .repository import Repository

#: How many differing fields a refusal lists.
MAX_LISTED = 6
ENGINE_REASON = (
    "the engine backend cannot hold two versions: the tensorrtllm backend takes its engine from the parameter "
    "gpt_model_path of tensorrt_llm/config.pbtxt, and a config.pbtxt is per model, shared by every version "
    "(Triton has no per-version config), so a second engine cannot be a second version. Roll engines out side "
    "by side instead: `trtpipe k8s BUILD_B -o DIR --canary-of BUILD_A` (docs/compare.md), or redeploy")


def refusal(repo: Repository, source: Repository) -> str | None:
    """Why SOURCE's served version cannot be a version of REPO's tensorrt_llm, or None."""
    for check in (backend_refusal, model_refusal, tokenizer_refusal, config_refusal):
        message = check(repo, source)
        if message:
            return message
    return None


def refuse_unless_compatible(repo: Repository, source: Repository) -> None:
    message = refusal(repo, source)
    if message:
        raise UserError(message)


def backend_refusal(repo: Repository, source: Repository) -> str | None:
    for role, r in (("REPO", repo), ("SOURCE", source)):
        try:
            backend = backend_for(r.backend)
        except UserError:
            return (f"{role} {r.path}: its manifest names no backend trtpipe knows ({r.backend!r}); "
                    "re-run `trtpipe deploy`")
        if backend.builds_engine:
            return f"{role} {r.path} is served by a TensorRT-LLM engine: {ENGINE_REASON}"
        if backend.layout != INFLIGHT_BATCHER:
            return (f"{role} {r.path} has the llmapi layout ({r.backend} backend), whose repository-level files "
                    "(model.yaml's model, trtllm-serve.sh) name tensorrt_llm/1: versions are not expressible there. "
                    "Roll it out side by side with `trtpipe k8s BUILD_B -o DIR --canary-of BUILD_A`")
    if repo.backend != source.backend:
        return (f"REPO is served by the {repo.backend} backend and SOURCE by {source.backend}: the backend and its "
                "parameters are set in tensorrt_llm/config.pbtxt, once for every version; deploy SOURCE's build "
                f"with REPO's (`trtpipe deploy --runtime ...`)")
    return None


def model_refusal(repo: Repository, source: Repository) -> str | None:
    from ..compare.builds import MODEL_IDENTITY_FIELDS   # compare's definition of "the same model" (imports torch)

    a, b = repo.plan.get("model") or {}, source.plan.get("model") or {}
    differing = [f"{k}: {a.get(k)!r} in REPO, {b.get(k)!r} in SOURCE" for k in MODEL_IDENTITY_FIELDS
                 if a.get(k) != b.get(k)]
    if not differing:
        return None
    return (f"SOURCE {source.path} is a build of another model than REPO {repo.path} ("
            f"{'; '.join(differing[:MAX_LISTED])}): the versions of one tensorrt_llm share the ensemble, "
            "preprocessing and postprocessing models; deploy it as its own repository")


def tokenizer_dir(repo: Repository) -> Path:
    return repo.triton.tokenizer


def tokenizer_refusal(repo: Repository, source: Repository) -> str | None:
    a, b = tokenizer_dir(repo), tokenizer_dir(source)
    if same_files(a, b):
        return None
    from ..tokenizer import same_tokenizer

    try:
        same = same_tokenizer(a, b)
    except Exception as exc:  # transformers raises many types for broken tokenizer files
        return f"the tokenizer of REPO ({a}) or SOURCE ({b}) does not load ({type(exc).__name__}: {exc})"
    if same:
        return None
    return (f"REPO and SOURCE have different tokenizers (vocabulary, added or special tokens; {a} vs {b}): "
            "REPO's preprocessing and postprocessing tokenize for every version; deploy SOURCE as its own repository")


def same_files(a: Path, b: Path) -> bool:
    names = sorted(p.name for p in a.iterdir() if p.is_file()) if a.is_dir() else []
    other = sorted(p.name for p in b.iterdir() if p.is_file()) if b.is_dir() else []
    return bool(names) and names == other and all((a / n).read_bytes() == (b / n).read_bytes() for n in names)


def config_refusal(repo: Repository, source: Repository) -> str | None:
    models, other = repo.triton.names, source.triton.names
    if models != other:
        return (f"REPO holds the models {', '.join(models)} and SOURCE {', '.join(other)}: they are not the same "
                "deployment layout; redeploy both with this trtpipe")
    differing = []
    for name in models:
        a, b = (model_config(r, name) for r in (repo, source))
        differing += [f"{name} {d}" for d in message_differences(a, b)]
    if not differing:
        return None
    more = f" (and {len(differing) - MAX_LISTED} more)" if len(differing) > MAX_LISTED else ""
    return (f"REPO and SOURCE differ in settings Triton keeps per model, not per version (config.pbtxt is the "
            f"model's, every version shares it): {'; '.join(differing[:MAX_LISTED])}{more}. Deploy SOURCE's "
            "checkpoint with the plan REPO was deployed with (`trtpipe deploy --checkpoint CKPT --plan PLAN`) and "
            "add that")


def model_config(repo: Repository, name: str):
    """NAME's ModelConfig, tensorrt_llm's without its version_policy (the one field versions may change)."""
    config = repo.triton.config(name)
    stripped = type(config)()
    stripped.CopyFrom(config)
    stripped.ClearField("version_policy")
    return stripped


def message_differences(a, b, path: str = "") -> list[str]:
    """Every field whose value differs between the messages `a` (REPO's) and `b` (SOURCE's), by its path."""
    differences = []
    for field in a.DESCRIPTOR.fields:
        where = f"{path}.{field.name}" if path else field.name
        va, vb = getattr(a, field.name), getattr(b, field.name)
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            differences += map_differences(field, va, vb, where)
        elif field.is_repeated:
            differences += repeated_differences(field, va, vb, where)
        elif field.message_type is not None:
            if va != vb:
                differences += message_differences(va, vb, where)
        elif va != vb:
            differences.append(f"{where}: {shown(field, va)} in REPO, {shown(field, vb)} in SOURCE")
    return differences


def map_differences(field, va, vb, where: str) -> list[str]:
    differences = []
    nested = field.message_type.fields_by_name["value"].message_type is not None
    for key in sorted(set(va) | set(vb)):
        if key not in va or key not in vb:
            differences.append(f"{where}[{key!r}]: only in {'SOURCE' if key not in va else 'REPO'}")
        elif nested and va[key] != vb[key]:
            differences += message_differences(va[key], vb[key], f"{where}[{key!r}]")
        elif not nested and va[key] != vb[key]:
            differences.append(f"{where}[{key!r}]: {va[key]!r} in REPO, {vb[key]!r} in SOURCE")
    return differences


def repeated_differences(field, va, vb, where: str) -> list[str]:
    if len(va) != len(vb):
        return [f"{where}: {len(va)} entries in REPO, {len(vb)} in SOURCE"]
    if field.message_type is None:
        return [] if list(va) == list(vb) else [f"{where}: {list(va)} in REPO, {list(vb)} in SOURCE"]
    differences = []
    for i, (x, y) in enumerate(zip(va, vb)):
        differences += message_differences(x, y, f"{where}[{i}]")
    return differences


def shown(field, value) -> str:
    if field.enum_type is not None:
        return field.enum_type.values_by_number[value].name if value in field.enum_type.values_by_number else str(value)
    return repr(value)
