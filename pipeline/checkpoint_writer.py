"""Write a checkpoint in the layout of another, with new weights given merged, one decoder layer at a time
(sparsify, distill).

The output has exactly the source checkpoint's layout: the same rank files, tensor names, shapes and dtypes,
declared up front from the source's headers. The embedding, ln_f and lm_head are copied byte for byte, and so
are the scaling factors of a quantized source; each decoder layer's linears and norms are given as the reader
merges them (`runtime.trtllm_reader.Layer`: whole-model float32 values) and split back into every rank's share
(`Rank.linear_part`). A float weight is cast to the checkpoint's dtype; an FP8 or INT8 one is quantized with
the source rank's own weights_scaling_factor, so the output is what the source's scales make of the new values
(distill's quantization-aware training). Nothing holds more than one layer.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .checkpoint import LAYER_TENSOR, CheckpointConfig, RankFile, open_rank_files
from .calibrate.rounding import fp8_codes, int8_codes, round_weight
from .runtime.trtllm_reader import Layer
from .safetensors_stream import SafetensorsWriter, TensorSpec, torch_dtype


class LayerwiseCheckpointWriter:
    """`source`'s layout in `out`, its decoder layers written in order with `write_layer`."""

    def __init__(self, source: Path, cfg: CheckpointConfig, out: Path):
        self.cfg, self.out = cfg, Path(out)
        self.ranks = open_rank_files(Path(source), cfg)
        self._writers: dict[int, SafetensorsWriter] = {}
        self._layer_names: dict[int, dict[int, list[str]]] = {}
        for rf in self.ranks:
            outer, layers = [], {}
            for name in sorted(rf.names()):
                m = LAYER_TENSOR.match(name)
                (layers.setdefault(int(m.group(1)), []) if m else outer).append(name)
            ordered = outer + [name for local in sorted(layers) for name in layers[local]]
            specs = [TensorSpec(name, rf.file.dtype_code(name), rf.file.shape(name)) for name in ordered]
            writer = SafetensorsWriter(self.out / rf.path.name, specs, metadata={"format": "pt"})
            for name in outer:
                writer.write([rf.file.rows(name)])
            self._writers[rf.rank], self._layer_names[rf.rank] = writer, layers

    def write_layer(self, index: int, layer: Layer) -> None:
        """Global decoder layer `index` (merged float weights) into every rank file that holds it."""
        family, arch = self.cfg.family, self.cfg.arch
        specs = {lin.name: lin for lin in family.linears}
        for rf in self.ranks:
            local = index - rf.layer_offset
            if local not in self._layer_names[rf.rank]:
                continue
            for name in self._layer_names[rf.rank][local]:
                inner, kind = LAYER_TENSOR.match(name).group(2).rsplit(".", 1)
                if inner in specs and kind in ("weight", "bias"):
                    lin = layer.linears[inner]
                    part = rf.position.linear_part(arch, specs[inner], lin.weight if kind == "weight" else lin.bias,
                                                   kind)
                    self._write(rf, name, self._stored(rf, name, part))
                elif inner in layer.norms and kind == "weight":
                    self._write(rf, name, self._stored(rf, name, layer.norms[inner]))
                else:                        # a scaling factor: the source's own
                    self._writers[rf.rank].write([rf.file.rows(name)])

    @staticmethod
    def _stored(rf: RankFile, name: str, value: torch.Tensor) -> torch.Tensor:
        """`value` in the dtype the source stores `name` in (quantized with the source's scale)."""
        dtype = torch_dtype(rf.file.dtype_code(name))
        value = value.detach().float()
        if dtype in (torch.float8_e4m3fn, torch.int8):
            scale = rf.read(name[: -len("weight")] + "weights_scaling_factor").float().reshape(-1)
            codes = fp8_codes if dtype == torch.float8_e4m3fn else int8_codes
            return round_weight(value, scale, codes, None).to(dtype)
        return value.to(dtype).contiguous()

    def _write(self, rf: RankFile, name: str, tensor: torch.Tensor) -> None:
        writer = self._writers[rf.rank]
        if writer.pending() != name:
            raise AssertionError(f"{rf.path.name}: wrote {name} while {writer.pending()} is next")
        writer.write(tensor.contiguous())

    def close(self, config: CheckpointConfig) -> None:
        """Finish every rank file (all layers written) and write `config` as config.json."""
        for writer in self._writers.values():
            writer.close()
        config.write(self.out)
