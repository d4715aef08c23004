"""Opens a GGUF file memory-mapped and turns its failure modes into clear errors.

The header (metadata and tensor table) is parsed here directly: `gguf.GGUFReader` builds a
numpy view per array element and took 8 s (SmolLM2) to 25 s (Gemma 3's 262k vocab) before any
weight was read. Tensor data stays memory-mapped, shaped as `gguf.GGUFReader` would shape it,
until `model/weights.py` repacks each tensor for the device.
"""

from __future__ import annotations

import dataclasses
import mmap
import os
import pathlib
import struct
from typing import Any

import numpy as np

import gguf


class GGUFLoadError(ValueError):
    """The file cannot be read as a model: not GGUF, truncated, or of an unsupported kind."""


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    name: str
    ggml_type: gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # numpy order: [N, K] for matrices (GGUF ne reversed)
    data: np.ndarray  # memory-mapped: float [N, K] for F32/F16, uint8 [N, row bytes] otherwise


# GGUF value types: struct format of scalars, numpy dtype of arrays; 8 = string, 9 = array
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_ARRAY_DTYPES = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1", 10: "<u8", 11: "<i8", 12: "<f8"}


class _Cursor:
    def __init__(self, buf: Any, size: int) -> None:
        self.buf, self.size, self.pos = buf, size, 0

    def need(self, n: int) -> None:
        if self.pos + n > self.size:
            raise GGUFLoadError(f"truncated header (needs byte {self.pos + n}, file has {self.size})")

    def unpack(self, fmt: str) -> Any:
        n = struct.calcsize(fmt)
        self.need(n)
        values = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += n
        return values if len(values) > 1 else values[0]

    def string(self) -> str:
        length = self.unpack("<Q")
        self.need(length)
        self.pos += length
        return bytes(self.buf[self.pos - length : self.pos]).decode("utf-8", "surrogateescape")

    def value(self, vtype: int) -> Any:
        if vtype == 8:
            return self.string()
        if vtype == 9:
            etype, count = self.unpack("<IQ")
            if etype in (8, 9):
                return [self.value(etype) for _ in range(count)]
            if etype not in _ARRAY_DTYPES:
                raise GGUFLoadError(f"unknown GGUF array element type {etype}")
            dtype = np.dtype(_ARRAY_DTYPES[etype])
            self.need(dtype.itemsize * count)
            arr = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos)
            self.pos += dtype.itemsize * count
            return (arr.astype(bool) if etype == 7 else arr).tolist()
        if vtype not in _SCALARS:
            raise GGUFLoadError(f"unknown GGUF value type {vtype}")
        return self.unpack(_SCALARS[vtype])


def read_header(path: str | os.PathLike[str]) -> tuple[dict[str, Any], list[tuple[str, tuple[int, ...], int, int]], int, int]:
    """Returns (metadata, [(name, ne, ggml type, offset)], data start, file size)."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        if size < 24:
            raise GGUFLoadError("not a GGUF file (too short)")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            cur = _Cursor(buf, size)
            magic, version, num_tensors, num_kv = cur.unpack("<4sIQQ")
            if magic != b"GGUF":
                raise GGUFLoadError(f"not a GGUF file (magic {magic!r})")
            if version not in (2, 3):
                raise GGUFLoadError(f"unsupported GGUF version {version}")
            meta: dict[str, Any] = {}
            for _ in range(num_kv):
                key = cur.string()
                meta[key] = cur.value(cur.unpack("<I"))
            tensors = []
            for _ in range(num_tensors):
                name = cur.string()
                n_dims = cur.unpack("<I")
                ne = tuple(int(d) for d in struct.unpack_from(f"<{n_dims}Q", buf, cur.pos)) if n_dims else ()
                cur.need(8 * n_dims)
                cur.pos += 8 * n_dims
                ggml_type, offset = cur.unpack("<IQ")
                tensors.append((name, ne, ggml_type, offset))
            align = int(meta.get("general.alignment", 32))
            data_start = (cur.pos + align - 1) // align * align
    return meta, tensors, data_start, size


class GGUFFile:
    """Metadata (key -> python value) and tensors of one GGUF file, memory-mapped."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = pathlib.Path(path)
        if not self.path.is_file():
            raise GGUFLoadError(f"{self.path}: no such file")
        try:
            meta, infos, data_start, size = read_header(self.path)
        except GGUFLoadError as e:
            raise GGUFLoadError(f"{self.path}: {e}") from None
        except (UnicodeDecodeError, struct.error, ValueError, OverflowError, MemoryError) as e:
            raise GGUFLoadError(f"{self.path}: corrupt GGUF header ({e})") from e
        self.metadata = meta
        self.size_bytes = size
        self.tensors: dict[str, TensorInfo] = {}
        mapped = np.memmap(self.path, dtype=np.uint8, mode="r") if infos else None
        for name, ne, type_id, offset in infos:
            try:
                qtype = gguf.GGMLQuantizationType(type_id)
            except ValueError:
                raise GGUFLoadError(f"{self.path}: tensor {name!r} has unknown type id {type_id}") from None
            block, type_size = gguf.GGML_QUANT_SIZES[qtype]
            shape = tuple(reversed(ne))
            if ne and ne[0] % block:
                raise GGUFLoadError(f"{self.path}: tensor {name!r} row of {ne[0]} is not a whole number of blocks")
            n_bytes = int(np.prod(ne, dtype=np.int64)) // block * type_size
            start = data_start + offset
            if start + n_bytes > size:
                raise GGUFLoadError(
                    f"{self.path}: truncated: tensor {name!r} ends at byte {start + n_bytes} but the file has {size}"
                )
            raw = mapped[start : start + n_bytes]
            if qtype == gguf.GGMLQuantizationType.F32:
                data = raw.view(np.float32).reshape(shape)
            elif qtype == gguf.GGMLQuantizationType.F16:
                data = raw.view(np.float16).reshape(shape)
            else:
                data = raw.reshape(*shape[:-1], ne[0] // block * type_size)
            self.tensors[name] = TensorInfo(name, qtype, shape, data)

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    @property
    def name(self) -> str:
        return str(self.metadata.get("general.name") or self.path.stem)

    def tensor(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise GGUFLoadError(f"{self.path}: missing tensor {name!r}") from None
