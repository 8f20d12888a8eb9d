"""Read Hugging Face safetensors lazily and write safetensors files one tensor at a time.

`safetensors.torch.save_file` needs every tensor of a file in memory at once. The converter instead
knows each output tensor's name, dtype and shape up front, writes the header first and then streams
the tensors in order, so peak memory follows the largest tensor rather than the model.

Dtypes are safetensors codes ("F16", "F8_E4M3", ...) and torch is imported only where a tensor is read
or written: a conversion whose tensors are all byte copies never loads torch (about 2 s of start-up).
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

from typing import TYPE_CHECKING

from .errors import UserError

if TYPE_CHECKING:
    import torch

#: bytes per element of each safetensors dtype code trtpipe reads or writes
ITEM_SIZE = {"F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "I8": 1, "U8": 1, "I32": 4, "I64": 8}


def torch_dtype(code: str) -> torch.dtype | None:
    """The torch dtype of a safetensors dtype code (None for a code trtpipe does not handle)."""
    import torch

    return {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F8_E4M3": torch.float8_e4m3fn,
            "I8": torch.int8, "U8": torch.uint8, "I32": torch.int32, "I64": torch.int64}.get(code)


def dtype_code(dtype: torch.dtype) -> str:
    """The safetensors code of a torch dtype."""
    return next(code for code in ITEM_SIZE if torch_dtype(code) == dtype)


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str                     # safetensors code
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * ITEM_SIZE[self.dtype]


@dataclass(frozen=True)
class SourceRows:
    """A contiguous run of rows of a tensor in a safetensors file, not yet read."""

    path: Path
    offset: int          # absolute byte offset in the file
    length: int
    dtype: str           # safetensors code
    shape: tuple[int, ...]

    def load(self) -> torch.Tensor:
        import torch

        buf = torch.empty(self.length, dtype=torch.uint8)  # not zero-filled, unlike bytearray
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            if f.readinto(buf.numpy()) != self.length:
                raise UserError(f"{self.path}: a tensor is cut short; the file is truncated, download it again")
        return buf.view(torch_dtype(self.dtype)).reshape(self.shape)


class SafetensorsWriter:
    """Writes a safetensors file whose tensors are declared up front and then written in order."""

    def __init__(self, path: Path, specs: list[TensorSpec], metadata: dict[str, str] | None = None):
        self.path = Path(path)
        self._specs = list(specs)
        self._next = 0
        header: dict = {"__metadata__": metadata} if metadata else {}
        offset = 0
        for spec in self._specs:
            header[spec.name] = {"dtype": spec.dtype, "shape": list(spec.shape),
                                 "data_offsets": [offset, offset + spec.nbytes]}
            offset += spec.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self._file = open(self.path, "wb", buffering=0)
        self._file.write(struct.pack("<Q", len(raw)))
        self._file.write(raw)

    def pending(self) -> str | None:
        """The name of the next tensor to write (None when all are written)."""
        return self._specs[self._next].name if self._next < len(self._specs) else None

    def write(self, data: torch.Tensor | list[SourceRows]) -> None:
        """Write the next declared tensor: a tensor, or source rows copied file-to-file unchanged."""
        spec = self._specs[self._next]
        if not isinstance(data, list):
            if dtype_code(data.dtype) != spec.dtype or tuple(data.shape) != spec.shape:
                raise AssertionError(f"{spec.name}: produced {data.dtype} {tuple(data.shape)}, "
                                     f"declared {spec.dtype} {spec.shape}")
            self._file.write(data.contiguous().view(-1).view(torch_dtype("U8")).numpy().data)
        else:
            if sum(p.length for p in data) != spec.nbytes or any(p.dtype != spec.dtype for p in data):
                raise AssertionError(f"{spec.name}: source rows do not match the declared {spec.dtype} {spec.shape}")
            for piece in data:
                self._copy(piece)
        self._next += 1

    def _copy(self, piece: SourceRows) -> None:
        """Copy bytes in the kernel (copy_file_range) where possible, like `cp` does."""
        with open(piece.path, "rb", buffering=0) as src:
            done = 0
            try:
                while done < piece.length:
                    n = os.copy_file_range(src.fileno(), self._file.fileno(), piece.length - done,
                                           piece.offset + done)
                    if n == 0:
                        raise UserError(f"{piece.path}: unexpected end of file; the file is truncated")
                    done += n
            except (AttributeError, OSError):  # no copy_file_range here: plain read and write
                self._file.write(SourceRows(piece.path, piece.offset + done, piece.length - done, "U8",
                                            (piece.length - done,)).load().numpy().data)

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


class SafetensorsFile:
    """One safetensors file whose tensors are read on demand with positioned reads.

    Plain reads rather than a memory map: pages of a mapped file count in the process's RSS for as long
    as the mapping lives, so streaming a whole model through one would grow RSS to the model's size.
    """

    def __init__(self, path: Path):
        self.path = Path(path)
        self._data_start, header = read_header(self.path)
        self._info = {name: info for name, info in header.items() if name != "__metadata__"}

    def names(self) -> set[str]:
        return set(self._info)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._info[name]["shape"])

    def dtype_code(self, name: str) -> str:
        """The safetensors dtype code ("F16", "F8_E4M3", ...) of a tensor."""
        return self._info[name]["dtype"]

    def rows(self, name: str, rows: tuple[int, int] | None = None) -> SourceRows:
        """Where the tensor, or the given range of its rows, lies on disk (nothing is read)."""
        info = self._info[name]
        dtype = info["dtype"]
        if dtype not in ITEM_SIZE:
            raise UserError(f"{self.path}: tensor {name} has unsupported dtype {dtype}")
        shape = list(info["shape"])
        begin, end = info["data_offsets"]
        if rows is not None:
            row_bytes = (end - begin) // shape[0] if shape[0] else 0
            begin, end = begin + rows[0] * row_bytes, begin + rows[1] * row_bytes
            shape[0] = rows[1] - rows[0]
        return SourceRows(self.path, self._data_start + begin, end - begin, dtype, tuple(shape))

    def read(self, name: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """The tensor, or only the given range of its rows (reading only those bytes)."""
        return self.rows(name, rows).load()


class LazyWeights:
    """The tensors of a Hugging Face directory (one or many safetensors files), read on demand."""

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        self._where: dict[str, SafetensorsFile] = {}
        for f in self._list_files():
            file = SafetensorsFile(f)
            for name in file.names():
                self._where[name] = file

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

    def names(self) -> set[str]:
        return set(self._where)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._where[name].shape(name)

    def dtype_code(self, name: str) -> str:
        return self._where[name].dtype_code(name)

    def rows(self, name: str, rows: tuple[int, int] | None = None) -> SourceRows:
        """Where the tensor, or the given range of its rows, lies on disk (nothing is read)."""
        return self._where[name].rows(name, rows)

    def read(self, name: str, rows: tuple[int, int] | None = None,
             cols: tuple[int, int] | None = None) -> torch.Tensor:
        """The tensor, or only the given row/column range. A row range reads only those bytes."""
        tensor = self.rows(name, rows).load()
        return tensor[:, cols[0]:cols[1]] if cols is not None else tensor


def header_problem(header) -> str | None:
    """What makes a parsed safetensors header unusable: it must map each tensor name to its dtype, shape and two
    data offsets (a JSON list, or an entry without them, was an AttributeError / KeyError, exit 1)."""
    if not isinstance(header, dict):
        return f"its header is a JSON {type(header).__name__}, not an object of tensors"
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(info, dict) or not isinstance(info.get("dtype"), str) \
                or not isinstance(info.get("shape"), list) or not isinstance(info.get("data_offsets"), list) \
                or len(info["data_offsets"]) != 2 or not all(isinstance(o, int) for o in info["data_offsets"]):
            return f"its header entry for {name!r} lacks a dtype, shape or two data offsets"
    return None


def read_header(path: Path) -> tuple[int, dict]:
    """(offset of the data section, header) of a safetensors file, refusing truncated files."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise UserError(f"{path}: not a readable safetensors file (truncated, no header); "
                            "write or download it again")
        (n,) = struct.unpack("<Q", head)
        try:
            header = json.loads(f.read(n))
        except (ValueError, MemoryError):
            raise UserError(f"{path}: not a readable safetensors file (corrupt header); "
                            "write or download it again") from None
    problem = header_problem(header)
    if problem:
        raise UserError(f"{path}: not a readable safetensors file ({problem}); write or download it again")
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    size = path.stat().st_size
    if size < 8 + n + end:
        raise UserError(f"{path}: truncated safetensors file ({size} bytes, header promises {8 + n + end}); "
                        "download it again")
    return 8 + n, header
