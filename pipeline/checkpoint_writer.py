"""Write a float TensorRT-LLM checkpoint whose decoder layers come merged, one at a time (sparsify, distill).

The output has exactly the source checkpoint's layout: the same rank files, tensor names, shapes and dtypes,
declared up front from the source's headers. The embedding, ln_f and lm_head are copied byte for byte; each
decoder layer is given as the reader merges it (`runtime.trtllm_reader.Layer`: whole-model float32 linears and
norms) and split back into every rank's share (`Rank.linear_part`), cast to the checkpoint's dtype. Nothing
holds more than one layer.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .checkpoint import LAYER_TENSOR, CheckpointConfig, RankFile, open_rank_files
from .runtime.trtllm_reader import Layer
from .safetensors_stream import SafetensorsWriter, TensorSpec, torch_dtype


class FloatCheckpointWriter:
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
                if inner in specs:
                    lin = layer.linears[inner]
                    tensor = rf.position.linear_part(arch, specs[inner], lin.weight if kind == "weight" else lin.bias,
                                                     kind)
                else:
                    tensor = layer.norms[inner]
                self._write(rf, name, tensor)

    def _write(self, rf: RankFile, name: str, tensor: torch.Tensor) -> None:
        writer = self._writers[rf.rank]
        if writer.pending() != name:
            raise AssertionError(f"{rf.path.name}: wrote {name} while {writer.pending()} is next")
        writer.write(tensor.detach().to(torch_dtype(rf.file.dtype_code(name))).contiguous())

    def close(self, config: CheckpointConfig) -> None:
        """Finish every rank file (all layers written) and write `config` as config.json."""
        for writer in self._writers.values():
            writer.close()
        config.write(self.out)
