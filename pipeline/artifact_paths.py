"""What a `trtpipe package` archive must not name: the paths of the machine the build was made on.

Those are the build directory, the home directory, and the local model directories outside the build that
the build's files record: build.json's --model and --model-dir, and plan.json's model (for the pytorch
backend that is the source model itself: its plan, and so the deployed repository's manifest, is made from
the Hugging Face model, not from a checkpoint inside the build). In a shipped JSON file the build's paths
become relative to it (`pipeline.outputs.portable`), the home directory `~`, and a local model directory
its last component, as build.json's model is named in the archive; the checkpoint fingerprint identifies
the weights.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from .outputs import portable

#: Files larger than this are weights or engines (binary tensors): they are not searched for paths.
TEXT_LIMIT = 64 << 20


@dataclass(frozen=True)
class BuildMachine:
    build_dir: Path
    models: tuple[str, ...] = ()   # local model directories outside the build, absolute, longest first

    @classmethod
    def of(cls, build_dir: Path, summary: dict) -> BuildMachine:
        """The machine of the build in BUILD_DIR (absolute), whose build.json is SUMMARY."""
        options = summary["options"]
        named = [options.get("model"), options.get("model_dir"), planned_model_path(build_dir)]
        local = {portable(p, build_dir).rstrip("/") for p in named if isinstance(p, str) and p}
        models = sorted((m for m in local if m and Path(m).is_absolute()), key=len, reverse=True)
        return cls(build_dir, tuple(models))

    def needles(self) -> list[str]:
        home = os.path.expanduser("~")
        return [str(self.build_dir), *self.models, *([home] if home not in ("/", "~") else [])]

    def named_in(self, data: bytes | Path) -> bool:
        """True when DATA (bytes, or a file no larger than TEXT_LIMIT) names any of the machine's paths."""
        if isinstance(data, Path):
            if data.stat().st_size > TEXT_LIMIT:
                return False
            data = data.read_bytes()
        return any(n.encode() in data for n in self.needles())

    def neutral(self, value):
        """JSON VALUE as shipped: the build's and home's paths portable, a local model by its last component."""
        return self.renamed(portable(value, self.build_dir))

    def renamed(self, value):
        if isinstance(value, dict):
            return {self.renamed(k): self.renamed(v) for k, v in value.items()}
        if isinstance(value, list):
            return [self.renamed(v) for v in value]
        if isinstance(value, str):
            for model in self.models:
                value = value.replace(model, Path(model).name)
        return value

    def shipped_model(self, spec: str) -> str:
        """The model as the archive names it: a preset or hub id as given; a local path outside the build by
        its last component only."""
        spec = self.neutral(spec)
        return Path(spec).name if Path(spec).is_absolute() else spec


def planned_model_path(build_dir: Path) -> str | None:
    """plan.json's model path (None when the build has no readable plan.json)."""
    try:
        return (json.loads((build_dir / "plan.json").read_text()).get("model") or {}).get("path")
    except (OSError, ValueError, AttributeError):
        return None
