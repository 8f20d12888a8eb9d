"""Read Hugging Face safetensors lazily and write safetensors files one tensor at a time.

`safetensors.torch.save_file` needs every tensor of a file in memory at once. The converter instead
knows each output tensor's name, dtype and shape up front, writes the header first and then streams
the tensors in order, so peak memory follows the largest tensor rather than the model.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from .errors import UserError

_ST_DTYPES = {
    torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float8_e4m3fn: "F8_E4M3",
    torch.int8: "I8", torch.uint8: "U8", torch.int32: "I32", torch.int64: "I64",
}


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.empty((), dtype=self.dtype).element_size()


class SafetensorsWriter:
    """Writes a safetensors file whose tensors are declared up front and then written in order."""

    def __init__(self, path: Path, specs: list[TensorSpec], metadata: dict[str, str] | None = None):
        self.path = Path(path)
        self._specs = list(specs)
        self._next = 0
        header: dict = {"__metadata__": metadata} if metadata else {}
        offset = 0
        for spec in self._specs:
            header[spec.name] = {"dtype": _ST_DTYPES[spec.dtype], "shape": list(spec.shape),
                                 "data_offsets": [offset, offset + spec.nbytes]}
            offset += spec.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self._file = open(self.path, "wb")
        self._file.write(struct.pack("<Q", len(raw)))
        self._file.write(raw)

    def write(self, tensor: torch.Tensor) -> None:
        spec = self._specs[self._next]
        if tensor.dtype != spec.dtype or tuple(tensor.shape) != spec.shape:
            raise AssertionError(f"{spec.name}: produced {tensor.dtype} {tuple(tensor.shape)}, "
                                 f"declared {spec.dtype} {spec.shape}")
        self._file.write(tensor.contiguous().view(torch.uint8).numpy().data)
        self._next += 1

    def close(self) -> None:
        self._file.close()
        if self._next != len(self._specs):
            raise AssertionError(f"{self.path}: {len(self._specs) - self._next} declared tensors never written")

    def __enter__(self) -> "SafetensorsWriter":
        return self

    def __exit__(self, exc_type, *_):
        if exc_type is None:
            self.close()
        else:
            self._file.close()


class LazyWeights:
    """The tensors of a Hugging Face directory, memory-mapped, read slice by slice on demand."""

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        self._files = self._list_files()
        self._handles = {}
        self._where: dict[str, Path] = {}
        for f in self._files:
            handle = self._open(f)
            self._handles[f] = handle
            for name in handle.keys():
                self._where[name] = f

    def _list_files(self) -> list[Path]:
        index = self.directory / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError) as exc:
                raise UserError(f"{index} is not a valid safetensors index ({exc})") from None
            files = sorted({self.directory / f for f in weight_map.values()})
            missing = [f.name for f in files if not f.is_file()]
            if missing:
                raise UserError(f"{index} names shard(s) that are missing: {', '.join(missing)}")
            return files
        files = sorted(self.directory.glob("*.safetensors"))
        if files:
            return files
        if list(self.directory.glob("*.bin")):
            raise UserError(f"{self.directory} has only PyTorch .bin weights; trtpipe reads safetensors. "
                            "Convert them first (e.g. load with transformers and save_pretrained("
                            "safe_serialization=True))")
        raise UserError(f"{self.directory} has no weights (*.safetensors)")

    @staticmethod
    def _open(path: Path):
        check_complete(path)
        try:
            return safe_open(str(path), framework="pt")
        except (SafetensorError, OSError, ValueError) as exc:
            raise UserError(f"{path}: not a readable safetensors file ({exc}); the download may be "
                            "truncated or corrupt, fetch it again") from None

    def names(self) -> set[str]:
        return set(self._where)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def read(self, name: str, rows: tuple[int, int] | None = None,
             cols: tuple[int, int] | None = None) -> torch.Tensor:
        """The tensor, or only the given row/column range, read from the memory map."""
        sl = self._slice(name)
        try:
            if rows is None and cols is None:
                return sl[:]
            r = slice(*rows) if rows else slice(None)
            if cols is None:
                return sl[r]
            return sl[r, slice(*cols)]
        except Exception as exc:
            raise UserError(f"{self._where[name]}: cannot read tensor {name} ({exc}); the file may be "
                            "truncated or corrupt") from None

    def _slice(self, name: str):
        return self._handles[self._where[name]].get_slice(name)


def check_complete(path: Path) -> None:
    """Refuse a safetensors file that is shorter than its header says (a truncated download)."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise UserError(f"{path}: truncated safetensors file (no header)")
        (n,) = struct.unpack("<Q", head)
        try:
            header = json.loads(f.read(n))
        except ValueError:
            raise UserError(f"{path}: corrupt safetensors header") from None
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    size = path.stat().st_size
    if size < 8 + n + end:
        raise UserError(f"{path}: truncated safetensors file ({size} bytes, header promises {8 + n + end}); "
                        "download it again")
