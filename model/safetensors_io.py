"""A minimal safetensors reader that copies tensors (or leading-dim slices) straight from the file.

safetensors' own loader maps whole files into memory; the mapped pages it touches stay in the
process's resident set until the file is closed, so loading a big single-file checkpoint costs up
to twice its size. Reading with `readinto` into the destination tensor keeps the peak near the
final weights. Format: 8-byte little-endian header length, a JSON header, then raw little-endian data.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


class SafetensorsFormatError(ValueError):
    pass


@dataclass(frozen=True)
class TensorInfo:
    path: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # absolute byte offset of the data in the file
    nbytes: int


def read_header(path: Path) -> dict[str, TensorInfo]:
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise SafetensorsFormatError(f"{path} is too short to be a safetensors file")
        (n,) = struct.unpack("<Q", raw)
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise SafetensorsFormatError(f"{path} has an unreadable safetensors header: {exc}") from exc
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        if meta["dtype"] not in _DTYPES:
            raise SafetensorsFormatError(f"tensor {name} in {path.name} has unsupported dtype {meta['dtype']}")
        start, end = meta["data_offsets"]
        out[name] = TensorInfo(path, _DTYPES[meta["dtype"]], tuple(meta["shape"]), 8 + n + start, end - start)
    return out


def read_tensor(info: TensorInfo, rows: slice | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """The whole tensor, or rows [start, stop) of its first dimension, read without a file mapping.

    With `out` (a contiguous CPU tensor of the same dtype and shape) the bytes land there directly,
    with no temporary; otherwise a new tensor is returned."""
    shape = list(info.shape)
    offset, nbytes = info.offset, info.nbytes
    if rows is not None:
        start, stop, step = rows.indices(shape[0])
        if step != 1:
            raise ValueError("only contiguous row ranges can be read")
        row_bytes = info.nbytes // shape[0] if shape[0] else 0
        offset += start * row_bytes
        nbytes = (stop - start) * row_bytes
        shape[0] = stop - start
    fits = (out is not None and out.device.type == "cpu" and out.dtype == info.dtype
            and list(out.shape) == shape and out.is_contiguous())
    if not fits:
        out = torch.empty(shape, dtype=info.dtype)
    if nbytes:
        view = memoryview(out.view(torch.uint8).reshape(-1).numpy())
        with open(info.path, "rb") as f:
            f.seek(offset)
            if f.readinto(view) != nbytes:
                raise SafetensorsFormatError(f"{info.path} ends before the data of a tensor")
    return out
