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


def read_tensor(info: TensorInfo, rows: slice | None = None, cols: slice | None = None,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """The tensor, or rows [start, stop) of its first dimension and/or columns of its second, read
    with plain file reads (only the selected bytes) and no file mapping.

    With `out` (a contiguous CPU tensor of the same dtype and shape) the bytes land there directly,
    with no temporary; otherwise a new tensor is returned."""
    shape = list(info.shape)
    row_bytes = info.nbytes // shape[0] if shape and shape[0] else info.nbytes
    r0, r1 = 0, shape[0] if shape else 1
    if rows is not None:
        r0, r1, step = rows.indices(shape[0])
        if step != 1:
            raise ValueError("only contiguous row ranges can be read")
        shape[0] = r1 - r0
    c0, c1, col_bytes = 0, 0, row_bytes
    if cols is not None:
        if len(shape) != 2:
            raise ValueError("column ranges can be read from 2-D tensors only")
        c0, c1, step = cols.indices(shape[1])
        if step != 1:
            raise ValueError("only contiguous column ranges can be read")
        item = row_bytes // info.shape[1]
        shape[1] = c1 - c0
        col_bytes = shape[1] * item
        c0 *= item
    fits = (out is not None and out.device.type == "cpu" and out.dtype == info.dtype
            and list(out.shape) == shape and out.is_contiguous())
    if not fits:
        out = torch.empty(shape, dtype=info.dtype)
    if out.numel() == 0:
        return out
    view = memoryview(out.view(torch.uint8).reshape(-1).numpy())
    with open(info.path, "rb") as f:
        if cols is None:  # one contiguous read
            segments = [(info.offset + r0 * row_bytes, 0, (r1 - r0) * row_bytes)]
        else:  # one read per row
            segments = [(info.offset + r * row_bytes + c0, i * col_bytes, col_bytes) for i, r in enumerate(range(r0, r1))]
        for file_offset, out_offset, n in segments:
            f.seek(file_offset)
            if f.readinto(view[out_offset:out_offset + n]) != n:
                raise SafetensorsFormatError(f"{info.path} ends before the data of a tensor")
    return out
