"""Tensor I/O for the weight store: safetensors files written and read without copies.

`write_safetensors` streams each tensor's bytes from its storage (casting in small
pieces when publishing in another dtype); `load_weights` reads each tensor straight
into its parameter's storage; CUDA models go through one page-locked staging buffer per
direction. torch is imported inside the functions, so importing this module costs
nothing: the controller imports it through the weight store (for `WeightStoreError`) and
never calls into torch.
"""

from __future__ import annotations

import json
import struct
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any


class WeightStoreError(RuntimeError):
    """/dev/shm missing, full, or a version that is not there (raised by the weight store and by
    the reads and writes of its files)."""


# ---- the safetensors format, written and read without intermediate copies -------------------
#
#   [8 bytes: little-endian u64 header length N][N bytes: JSON header, space-padded]
#   [tensor bytes, back to back, in header offset order]
#   header: {"__metadata__": {...}, name: {"dtype": "F32", "shape": [...], "data_offsets": [b, e]}}
#
# safetensors' own `load_file` returns fresh tensors that `load_weights` would copy again, and
# its save needs the cast copy of the whole model in memory first; writing the bytes of each
# tensor straight from its storage and reading them straight into the parameters' storage
# leaves one write and one read: the floor a raw file copy sets (bench/weight_sync.py).

HEADER_ROOM = 1 << 20
"""Slack for the JSON header in the free-space check."""
CAST_CHUNK = 1 << 20
"""Elements cast per piece when publishing in another dtype (a few MiB: stays in cache)."""
HEADER_ALIGN = 8
"""safetensors pads the header so tensor data starts 8-byte aligned."""
MAX_HEADER = 100 << 20
"""A header longer than this is not a weight file of ours."""
COPY_CHUNK = 16 << 20
"""Bytes per read/write when copying a weight file (a few pages of a large file at a time)."""
_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
           "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}


def unique_state(model: Any) -> dict[str, Any]:
    """State dict with each shared storage once (tied lm_head dropped), detached."""
    seen: set[int] = set()
    out = {}
    for name, tensor in model.state_dict().items():
        key = tensor.untyped_storage().data_ptr()
        if key in seen:
            continue
        seen.add(key)
        out[name] = tensor.detach()
    return out


def out_dtype(tensor: Any, dtype: Any) -> Any:
    return dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype


def as_bytes(tensor: Any) -> memoryview:
    """The raw bytes of a contiguous CPU tensor (no copy)."""
    import torch

    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())


def write_safetensors(path: Path, state: dict[str, Any], dtype: Any, metadata: dict[str, str],
                      transform: Any = None) -> None:
    """`state`'s tensors as one safetensors file (floating ones cast to `dtype` unless None).

    `transform(name, tensor)`, when given, returns the tensor written in that one's place (same
    shape and dtype), computed one tensor at a time while the bytes are written: a merged LoRA
    export (workers/lora.py) never holds a merged copy of the whole model."""
    import torch

    codes = {getattr(torch, v): k for k, v in _DTYPES.items()}
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for name, t in state.items():
        out = out_dtype(t, dtype)
        if out not in codes:
            raise WeightStoreError(f"{name}: dtype {out} cannot be stored")
        size = t.numel() * out.itemsize
        header[name] = {"dtype": codes[out], "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % HEADER_ALIGN)
    scratch = None
    with open(path, "wb", buffering=0) as fh:
        fh.write(struct.pack("<Q", len(raw)) + raw)
        if transform is not None:
            for name, t in state.items():
                out = transform(name, t)
                _write_all(fh, as_bytes(out.to(out_dtype(t, dtype)).contiguous().cpu()))
            return
        if _gpu_staged(state.values(), dtype, header):
            # every tensor on the GPU: queue all device-to-host copies into one page-locked
            # buffer, wait once, write it in one go (not a synchronous copy per tensor)
            staging = _pinned("publish", offset)
            for name, t in state.items():
                begin, end = header[name]["data_offsets"]
                out = out_dtype(t, dtype)
                staging[begin:end].view(out).view(t.shape).copy_(t.detach().to(out), non_blocking=True)
            torch.cuda.synchronize()
            _write_all(fh, as_bytes(staging))
            return
        for t in state.values():
            out = out_dtype(t, dtype)
            if out == t.dtype:
                _write_all(fh, as_bytes(t.contiguous().cpu()))
                continue
            if t.device.type != "cpu":
                _write_all(fh, as_bytes(t.to(out).contiguous().cpu()))
                continue
            flat = t.reshape(-1)  # a view when contiguous
            if scratch is None or scratch.dtype != out:
                scratch = torch.empty(CAST_CHUNK, dtype=out)
            for lo in range(0, flat.numel(), CAST_CHUNK):
                piece = flat[lo:lo + CAST_CHUNK]
                part = scratch[:piece.numel()]
                part.copy_(piece)  # the cast, into a cache-sized buffer reused for every piece
                _write_all(fh, as_bytes(part))


def _write_all(fh: Any, data: memoryview) -> None:
    while len(data):
        n = fh.write(data)
        data = data[n:]


def _read_header(fh: Any, path: Path) -> tuple[dict[str, Any], int]:
    """(header without __metadata__, file offset where tensor data starts)."""
    head = fh.read(8)
    if len(head) != 8:
        raise WeightStoreError(f"{path}: not a safetensors file (too short)")
    (n,) = struct.unpack("<Q", head)
    if n > MAX_HEADER:
        raise WeightStoreError(f"{path}: not a safetensors file (header of {n} bytes)")
    try:
        header = json.loads(fh.read(n))
    except ValueError as exc:
        raise WeightStoreError(f"{path}: unreadable safetensors header ({exc})") from None
    header.pop("__metadata__", None)
    return header, 8 + n


def _read_into(fh: Any, target: memoryview) -> None:
    got = 0
    while got < len(target):
        n = fh.readinto(target[got:])
        if not n:
            raise WeightStoreError(f"{fh.name}: file ends early (truncated weight file)")
        got += n


def load_weights(model: Any, path: str | Path) -> float:
    """Copy v<N>.safetensors into `model` in place (tied weights follow); returns seconds.

    A tensor whose dtype, shape and device match its parameter is read straight into
    the parameter's memory; any other is read once and cast/moved by `copy_`.
    """
    import torch

    t0 = time.perf_counter()
    path = Path(path)
    params = model.state_dict()
    try:
        fh = open(path, "rb", buffering=0)  # noqa: SIM115 - closed below
    except FileNotFoundError:
        raise WeightStoreError(f"{path}: no such weight version") from None
    with fh:
        header, base = _read_header(fh, path)
        missing = [k for k in params if k not in header and not _is_tied(model, k)]
        unknown = [k for k in header if k not in params]
        if missing or unknown:
            raise WeightStoreError(f"{path}: does not fit this model: missing {missing[:5]}, "
                                   f"unexpected {unknown[:5]}")
        for name, info in header.items():
            if list(params[name].shape) != list(info["shape"]):
                raise WeightStoreError(f"{path}: {name} has shape {info['shape']}, "
                                       f"the model's is {list(params[name].shape)}")
        order = sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0])
        fh.seek(base)
        pos = 0
        if _gpu_staged([params[name] for name in header], None, header):
            _load_staged(fh, path, order, params)
            return time.perf_counter() - t0
        with torch.no_grad():
            for name, info in order:
                begin, end = info["data_offsets"]
                if begin != pos:
                    fh.seek(base + begin)
                file_dtype = getattr(torch, _DTYPES.get(info["dtype"], ""), None)
                if file_dtype is None:
                    raise WeightStoreError(f"{path}: {name} has unsupported dtype {info['dtype']}")
                dest = params[name]
                if (dest.dtype == file_dtype and dest.device.type == "cpu" and dest.is_contiguous()
                        and dest.numel() * dest.element_size() == end - begin):
                    _read_into(fh, as_bytes(dest))
                else:
                    buf = torch.empty(info["shape"], dtype=file_dtype)
                    if buf.numel() * buf.element_size() != end - begin:
                        raise WeightStoreError(f"{path}: {name}: offsets do not match its shape")
                    _read_into(fh, as_bytes(buf))
                    dest.copy_(buf)
                pos = end
    return time.perf_counter() - t0


def read_tensors(path: str | Path) -> tuple[dict[str, Any], dict[str, str]]:
    """(every tensor, the header's metadata) of a small safetensors file (a LoRA adapter): fresh
    CPU tensors, not read into a model."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as fh:
            return {name: fh.get_tensor(name) for name in fh.keys()}, dict(fh.metadata() or {})
    except FileNotFoundError:
        raise WeightStoreError(f"{path}: no such weight version") from None
    except (SafetensorError, OSError) as exc:
        raise WeightStoreError(f"{path}: unreadable safetensors file ({exc})") from None


def _is_tied(model: Any, name: str) -> bool:
    return bool(getattr(model.config, "tie_word_embeddings", False)) and name.startswith("lm_head.")


# ---- GPU models: one page-locked staging buffer per direction ----------------------------------

_PINNED: dict[str, Any] = {}
"""Reused page-locked host buffers ("publish", "load"), grown on demand: pinning is slow, reuse is free."""


def _pinned(kind: str, nbytes: int) -> Any:
    import torch

    buf = _PINNED.get(kind)
    if buf is None or buf.numel() < nbytes:
        _PINNED[kind] = buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    return buf[:nbytes]


def _gpu_staged(tensors: Iterable[Any], dtype: Any, header: dict[str, Any]) -> bool:
    """True when every tensor is on a CUDA device and every tensor's bytes start aligned
    to its element size (so a byte slice of the staging buffer can be viewed as it)."""
    tensors = list(tensors)
    if not tensors or any(t.device.type != "cuda" for t in tensors):
        return False
    for info in header.values():
        if isinstance(info, dict) and "data_offsets" in info:
            size = _dtype_size(info["dtype"])
            if size is None or info["data_offsets"][0] % size:
                return False
    return True


def _dtype_size(code: str) -> int | None:
    import torch

    name = _DTYPES.get(code)
    return getattr(torch, name).itemsize if name else None


def _load_staged(fh: Any, path: Path, order: list[tuple[str, dict]], params: dict[str, Any]) -> None:
    """Read the whole data region into a page-locked buffer, queue every host-to-device copy,
    wait once."""
    import torch

    end = max((info["data_offsets"][1] for _, info in order), default=0)
    staging = _pinned("load", end)
    _read_into(fh, as_bytes(staging))
    with torch.no_grad():
        for name, info in order:
            begin, stop = info["data_offsets"]
            file_dtype = getattr(torch, _DTYPES.get(info["dtype"], ""), None)
            if file_dtype is None:
                raise WeightStoreError(f"{path}: {name} has unsupported dtype {info['dtype']}")
            piece = staging[begin:stop].view(file_dtype)
            if piece.numel() != params[name].numel():
                raise WeightStoreError(f"{path}: {name}: offsets do not match its shape")
            params[name].copy_(piece.view(params[name].shape), non_blocking=True)
    torch.cuda.synchronize()


def copy_as_hf_weights(src: Path, dst: Path) -> None:
    """Copy a weight-store file, its header metadata set to {"format": "pt"} (what
    transformers requires of a safetensors checkpoint); the tensor bytes are streamed as they are
    (data offsets are relative to the end of the header, so a new header length is fine)."""
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        (n,) = struct.unpack("<Q", fin.read(8))
        header = json.loads(fin.read(n))
        header["__metadata__"] = {"format": "pt"}
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % HEADER_ALIGN)
        fout.write(struct.pack("<Q", len(raw)) + raw)
        while chunk := fin.read(COPY_CHUNK):
            fout.write(chunk)
