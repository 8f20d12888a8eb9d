"""TensorRT calibration cache (the IInt8EntropyCalibrator2 text format), for ONNX/TensorRT tooling.

Format (docs/upstream-facts.md §D): a header line `TRT-<version>-EntropyCalibration2`, then one line per tensor
`name: <8 hex digits>` holding the IEEE-754 float32 *scale*; the dynamic range a reader restores is
scale x 127. `<version>` is TensorRT's NV_TENSORRT_VERSION of the release TensorRT-LLM 1.2.1 ships with
(TensorRT 10.14.1: 10 * 10000 + 14 * 100 + 1 = 101401); TensorRT rejects caches from other versions.

The tensor names are those of the graph `trtpipe export-onnx` writes (pipeline/onnx/graph.py): the input of
each quantized linear after SmoothQuant's smoothing, `transformer.layers.N.attention.qkv` ... `mlp.proj`, and
K/V after rope, `transformer.layers.N.attention.k` / `.v`, so the cache applies to that model.onnx.
"""

from __future__ import annotations

import struct
from pathlib import Path

TENSORRT_VERSION = (10, 14, 1)


def version_tag(version: tuple[int, int, int] = TENSORRT_VERSION) -> int:
    """The header's version number: MAJOR*10000 + MINOR*100 + PATCH since TensorRT 10 (NV_TENSORRT_VERSION_INT),
    MAJOR*1000 + MINOR*100 + PATCH before (8.6.1 -> 8601)."""
    major, minor, patch = version
    return major * (10000 if major >= 10 else 1000) + minor * 100 + patch


def float_to_hex(value: float) -> str:
    return struct.pack(">f", value).hex()


def hex_to_float(text: str) -> float:
    return struct.unpack(">f", bytes.fromhex(text))[0]


def write_calibration_cache(path: Path, activation_amax: dict[str, float]) -> None:
    """One line per activation tensor: scale = amax / 127 (so that scale * 127 restores the range)."""
    lines = [f"TRT-{version_tag()}-EntropyCalibration2"]
    lines += [f"{name}: {float_to_hex(amax / 127.0)}" for name, amax in activation_amax.items()]
    path.write_text("\n".join(lines) + "\n")


def read_calibration_cache(path: Path) -> dict[str, float]:
    """The dynamic ranges (amax) of a cache, the way TensorRT's readers interpret it."""
    lines = path.read_text().splitlines()
    if not lines or not lines[0].startswith("TRT-"):
        raise ValueError(f"{path} is not a TensorRT calibration cache (first line {lines[:1]})")
    ranges = {}
    for line in lines[1:]:
        name, _, value = line.rpartition(": ")
        ranges[name] = hex_to_float(value) * 127.0
    return ranges
