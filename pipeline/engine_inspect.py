"""What TensorRT says about each rank's engine: its layers, their types and the tactics it chose.

`trtllm-build --profiling_verbosity` (choices layer_names_only|detailed|none, default layer_names_only;
tensorrt_llm/commands/build.py, v1.2.1) sets the TensorRT builder's ProfilingVerbosity, which decides what an
engine keeps about its layers. With `detailed`, TensorRT's engine inspector reads each layer back as JSON:

    engine = trt.Runtime(trt.Logger()).deserialize_cuda_engine(plan_bytes)
    engine.create_engine_inspector().get_engine_information(trt.LayerInformationFormat.JSON)
    -> {"Layers": [{"Name": ..., "LayerType": ..., "TacticName": ..., "TacticValue": ..., ...}, ...], ...}

With `layer_names_only` the "Layers" list holds only the names (strings), with `none` nothing (NVIDIA's engine
explorer, trex, refuses a graph whose layers are not objects: "enable detailed ProfilingVerbosity"); so compile runs
the inspector only after a `detailed` build, writes its JSON beside the engine (rank0.engine -> rank0.layers.json)
and summarises it in the engine manifest (`inspect_engines`). The inspector needs the `tensorrt` module, which
only NVIDIA's container has: where it is missing, the manifest says that inspection did not run, and why.

Unverified here: no TensorRT on this machine; tested only with a fake `tensorrt` module (tests/test_compile.py).
"""

from __future__ import annotations

import contextlib
import json
import re
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path

PROFILING_VERBOSITIES = ("layer_names_only", "detailed", "none")
#: trtllm-build's default (BuildConfig.profiling_verbosity), also what BuildConfig.from_dict takes when absent.
DEFAULT_PROFILING_VERBOSITY = "layer_names_only"
#: The verbosity whose engines carry layer types and tactics: the only one compile inspects.
INSPECTED_VERBOSITY = "detailed"
#: How many of the most used tactics the manifest lists per rank.
TOP_TACTICS = 10
#: How the inspector names the layers of the second and later optimization profiles.
PROFILE_SUFFIX = re.compile(r"\[profile (\d+)\]")
NOTE = ("unverified here: TensorRT's engine inspector has only run against a fake tensorrt module "
        "(tests/test_compile.py)")


def layers_path(engine: Path) -> Path:
    """Where one engine's layer JSON goes: rank0.engine -> rank0.layers.json."""
    return Path(engine).with_name(Path(engine).stem + ".layers.json")


def engine_information(engine: Path) -> str:
    """TensorRT's engine inspector on one serialized engine: its layer information, JSON text (GPU only).

    Raises ImportError when the `tensorrt` module is missing. `import tensorrt_llm` first loads TensorRT-LLM's
    plugin library (its `_common._init()`), without which an engine with plugin layers does not deserialize; its
    banner goes to stderr so that `compile --json` keeps stdout to itself.
    """
    import tensorrt as trt

    with contextlib.suppress(Exception), contextlib.redirect_stdout(sys.stderr):
        import tensorrt_llm  # noqa: F401
    engine_bytes = Path(engine).read_bytes()
    cuda_engine = trt.Runtime(trt.Logger()).deserialize_cuda_engine(engine_bytes)
    if cuda_engine is None:
        raise RuntimeError("TensorRT could not deserialize it (its log above says why)")
    return cuda_engine.create_engine_inspector().get_engine_information(trt.LayerInformationFormat.JSON)


def summarise_layers(info: dict) -> dict:
    """One rank's manifest entry: how many layers, how many of each type, and the tactics chosen most often.

    An engine with several optimization profiles (`multiple_profiles`) lists each profile's graph, the layers of
    all but the first named with a `[profile N]` suffix (NVIDIA's trex, `trex/parser.py`, counts the first by
    default); so the counts are the first profile's, and `profiles` and `layers_all_profiles` say what else there is.
    """
    layers = info.get("Layers") if isinstance(info, dict) else None
    if not isinstance(layers, list):
        raise ValueError("the inspector's JSON has no \"Layers\" list")
    profiles = {int(m.group(1)) for m in map(PROFILE_SUFFIX.search, map(_name, layers)) if m}
    first = [layer for layer in layers if not PROFILE_SUFFIX.search(_name(layer))]
    described = [layer for layer in first if isinstance(layer, dict)]
    types = Counter(str(layer.get("LayerType") or "unreported") for layer in described)
    tactics = Counter(t for t in map(_tactic, described) if t)
    return {"layers": len(first), "names_only": len(first) - len(described),
            "layer_types": dict(types.most_common()), "layers_with_tactic": sum(tactics.values()),
            "top_tactics": [{"tactic": name, "layers": n} for name, n in tactics.most_common(TOP_TACTICS)],
            "profiles": 1 + len(profiles), "layers_all_profiles": len(layers)}


def _name(layer) -> str:
    return str(layer.get("Name", "")) if isinstance(layer, dict) else str(layer)


def _tactic(layer: dict) -> str | None:
    """The layer's tactic as TensorRT names it ("TacticName"), else its number ("TacticValue")."""
    for key in ("TacticName", "TacticValue"):
        value = layer.get(key)
        if value not in (None, ""):
            return str(value)
    return None


def inspect_engines(engine_dir: Path, ranks: int, inspect: Callable[[Path], str] = engine_information) -> dict:
    """Inspect rank0..rank{ranks-1}.engine in `engine_dir`, write each one's layers JSON beside it, and return the
    manifest's `inspection`: per rank the summary, or (with a warning on stderr) that it did not run and why.
    Nothing is written unless every rank was inspected."""
    base = {"profiling_verbosity": INSPECTED_VERBOSITY, "verified_here": False, "note": NOTE}
    texts, summaries = {}, {}
    for rank in range(ranks):
        engine = Path(engine_dir) / f"rank{rank}.engine"
        try:
            text = inspect(engine)
            summaries[f"rank{rank}"] = {"file": layers_path(engine).name, **summarise_layers(json.loads(text))}
        except ImportError as exc:
            return _did_not_run(base, f"the tensorrt Python module is not importable here ({exc}); it is in "
                                      "NVIDIA's TensorRT-LLM container")
        except Exception as exc:   # a diagnostic: the engine itself was built and checked
            return _did_not_run(base, f"TensorRT's engine inspector failed on {engine.name}: "
                                      f"{type(exc).__name__}: {exc}")
        texts[layers_path(engine)] = text
    for path, text in texts.items():
        path.write_text(text)
    return {**base, "ran": True, "ranks": summaries}


def _did_not_run(base: dict, reason: str) -> dict:
    print(f"WARNING: engine inspection did not run: {reason}", file=sys.stderr, flush=True)
    return {**base, "ran": False, "reason": reason}
