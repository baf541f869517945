"""Minimal safetensors reader/writer (no dependency beyond torch + numpy).

Format: 8-byte little-endian header length N, then N bytes of JSON
  {"name": {"dtype": "F32", "shape": [..], "data_offsets": [begin, end]}, ...,
   "__metadata__": {"format": "pt"}}
padded with spaces to a multiple of 8, then the raw little-endian tensor data. Offsets are relative
to the start of the data section. Tensors are written in sorted-name order, back to back.
"""
import json
import struct

import numpy as np
import torch

# safetensors dtype name -> (torch dtype, numpy dtype used for the raw bytes)
_DTYPES = {
    "F64": (torch.float64, np.float64),
    "F32": (torch.float32, np.float32),
    "F16": (torch.float16, np.float16),
    "BF16": (torch.bfloat16, np.int16),  # numpy has no bfloat16: move the raw 16-bit patterns
    "I64": (torch.int64, np.int64),
    "I32": (torch.int32, np.int32),
    "I16": (torch.int16, np.int16),
    "I8": (torch.int8, np.int8),
    "U8": (torch.uint8, np.uint8),
    "BOOL": (torch.bool, np.bool_),
}
_TORCH_TO_NAME = {t: n for n, (t, _) in _DTYPES.items()}


def _to_bytes(t: torch.Tensor) -> bytes:
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().astype("<i2", copy=False).tobytes()
    arr = t.numpy()
    return arr.astype(arr.dtype.newbyteorder("<"), copy=False).tobytes()


def save_file(tensors: dict, path: str, metadata: dict = None) -> None:
    """Write {name: torch.Tensor} to `path`. Supported dtypes: see _DTYPES (F32, I32, BF16, ...)."""
    header = {}
    blobs = []
    offset = 0
    for name in sorted(tensors):
        t = tensors[name]
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in _TORCH_TO_NAME:
            raise TypeError(f"{name}: unsupported dtype {t.dtype}")
        data = _to_bytes(t)
        header[name] = {"dtype": _TORCH_TO_NAME[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    header["__metadata__"] = {"format": "pt", **(metadata or {})}
    hjson = json.dumps(header, separators=(",", ":")).encode("utf-8")
    hjson += b" " * ((-len(hjson)) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hjson)))
        f.write(hjson)
        for b in blobs:
            f.write(b)


def load_file(path: str) -> dict:
    """Read a safetensors file into {name: torch.Tensor} (dtypes preserved)."""
    with open(path, "rb") as f:
        raw = f.read()
    if len(raw) < 8:
        raise ValueError(f"{path}: too short for a safetensors file")
    (n,) = struct.unpack("<Q", raw[:8])
    if 8 + n > len(raw):
        raise ValueError(f"{path}: header length {n} exceeds the file size {len(raw)}")
    header = json.loads(raw[8:8 + n].decode("utf-8"))
    data = memoryview(raw)[8 + n:]
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = info["dtype"]
        if dtype not in _DTYPES:
            raise ValueError(f"{path}: tensor {name}: unsupported dtype {dtype}")
        tdt, ndt = _DTYPES[dtype]
        begin, end = info["data_offsets"]
        shape = info["shape"]
        count = int(np.prod(shape)) if shape else 1
        if end - begin != count * np.dtype(ndt).itemsize or end > len(data):
            raise ValueError(f"{path}: tensor {name}: data_offsets {begin}..{end} do not match "
                             f"shape {shape} of {dtype}")
        arr = np.frombuffer(data[begin:end], dtype=np.dtype(ndt).newbyteorder("<")).astype(ndt)
        t = torch.from_numpy(arr.copy()).reshape(shape)
        if tdt == torch.bfloat16:
            t = t.view(torch.bfloat16)
        out[name] = t
    return out


def load_metadata(path: str) -> dict:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n).decode("utf-8")).get("__metadata__", {})
