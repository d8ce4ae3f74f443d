"""Fast GGUF container reader: metadata and tensor directory from one ``mmap`` (numpy only, no torch).

``gguf.GGUFReader`` builds a numpy view per metadata element (~5 s for SmolLM2's 49k-token vocabulary on
this machine); this reader parses the same layout with ``struct`` in ~0.1 s. Dequantization stays with the
``gguf`` package (parrot.engine.loader.gguf_loader). Layout (little-endian, GGUF v2/v3):

    magic "GGUF" | u32 version | u64 n_tensors | u64 n_kv
    n_kv x      [ string key | u32 type | value ]          string = u64 len + utf-8 bytes
    n_tensors x [ string name | u32 n_dims | u64 ne[n_dims] | u32 ggml_type | u64 offset ]
    padding to general.alignment (default 32) | tensor data (offsets relative to here)
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NP_TYPES = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
             7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy/torch order (slowest first) = reversed ggml ``ne``
    qtype: GGMLQuantizationType
    offset: int  # absolute byte offset in the file
    nbytes: int


# (real path, size, mtime) -> the parse of that version of the file: the few most recent (see GGUFFile)
_PARSES: dict[tuple[str, int, int], tuple[dict[str, Any], list[GGUFTensorInfo]]] = {}


class GGUFFile:
    """Metadata (``fields``: key -> Python value) and tensors of a GGUF file. Raises ValueError if malformed.

    A load opens the file several times (config, formats, weights, tokenizer); the parse -- walking a 49k-token
    vocabulary's strings, ~0.15 s -- is done once per file version (path, size, mtime) and shared."""

    def __init__(self, path: str) -> None:
        self.path = path
        with open(path, "rb") as f:
            # copy-on-write: the pages are the page cache's (shared, read lazily); nothing here ever writes them, but
            # torch wants writable buffers to view them as tensors without a copy
            self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
            st = os.fstat(f.fileno())
        try:
            key = (os.path.realpath(path), st.st_size, st.st_mtime_ns)
            if key not in _PARSES:
                if len(_PARSES) >= 4:
                    _PARSES.pop(next(iter(_PARSES)))
                _PARSES[key] = self._parse()
            self.fields, self.tensors = _PARSES[key]
        except (struct.error, UnicodeDecodeError, KeyError) as exc:
            self._mm.close()
            raise ValueError(f"{path!r} is not a valid GGUF file: {exc!r}") from exc

    def get(self, key: str, default: Any = None) -> Any:
        return self.fields.get(key, default)

    def tensor_names(self) -> set[str]:
        return {t.name for t in self.tensors}

    def release(self, info: GGUFTensorInfo) -> None:
        """Drop the tensor's pages from this process's resident set (MADV_DONTNEED on the private mapping): a load
        that has consumed a tensor stops counting it, so the file and what was built from it are not resident
        together. Safe whatever still views it: nothing was written, so a later read faults the file's pages back
        in from the page cache."""
        page = mmap.PAGESIZE
        start = info.offset // page * page
        end = min(len(self._mm), -(-(info.offset + info.nbytes) // page) * page)
        if end > start and hasattr(self._mm, "madvise"):
            self._mm.madvise(mmap.MADV_DONTNEED, start, end - start)

    def raw(self, info: GGUFTensorInfo) -> np.ndarray:
        """The tensor's bytes as a uint8 array [rows, row_bytes] (what ``gguf.quants.dequantize`` takes); a view of
        the file mapping, no copy (do not write to it)."""
        block, type_size = GGML_QUANT_SIZES[info.qtype]
        row_bytes = info.shape[-1] // block * type_size
        data = np.frombuffer(self._mm, dtype=np.uint8, count=info.nbytes, offset=info.offset)
        return data.reshape(-1, row_bytes)

    # ---- parsing -----------------------------------------------------------------------------------------------
    def _parse(self) -> tuple[dict[str, Any], list[GGUFTensorInfo]]:
        mm = self._mm
        if mm[:4] != b"GGUF":
            raise ValueError(f"{self.path!r} does not start with the GGUF magic")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", mm, 4)
        if version not in (2, 3):
            raise ValueError(f"{self.path!r}: unsupported GGUF version {version} (or big-endian file)")
        pos = 24
        fields: dict[str, Any] = {}
        for _ in range(n_kv):
            key, pos = self._string(pos)
            (vtype,) = struct.unpack_from("<I", mm, pos)
            fields[key], pos = self._value(vtype, pos + 4)
        raw_infos = []
        for _ in range(n_tensors):
            name, pos = self._string(pos)
            (n_dims,) = struct.unpack_from("<I", mm, pos)
            ne = struct.unpack_from(f"<{n_dims}Q", mm, pos + 4)
            qtype, offset = struct.unpack_from("<IQ", mm, pos + 4 + 8 * n_dims)
            pos += 4 + 8 * n_dims + 12
            raw_infos.append((name, ne, GGMLQuantizationType(qtype), offset))
        align = int(fields.get("general.alignment", 32))
        data_start = (pos + align - 1) // align * align
        tensors = []
        for name, ne, qtype, offset in raw_infos:
            block, type_size = GGML_QUANT_SIZES[qtype]
            n_elems = int(np.prod(ne)) if ne else 1
            nbytes = n_elems // block * type_size
            start = data_start + offset
            if start + nbytes > len(mm):
                raise ValueError(f"{self.path!r}: tensor {name!r} extends past the end of the file (truncated?)")
            tensors.append(GGUFTensorInfo(name, tuple(int(d) for d in reversed(ne)), qtype, start, nbytes))
        return fields, tensors

    def _string(self, pos: int) -> tuple[str, int]:
        (n,) = struct.unpack_from("<Q", self._mm, pos)
        end = pos + 8 + n
        return self._mm[pos + 8:end].decode("utf-8", errors="replace"), end

    def _value(self, vtype: int, pos: int) -> tuple[Any, int]:
        if vtype in _SCALARS:
            fmt = _SCALARS[vtype]
            return struct.unpack_from(fmt, self._mm, pos)[0], pos + struct.calcsize(fmt)
        if vtype == _STRING:
            return self._string(pos)
        if vtype == _ARRAY:
            itype, count = struct.unpack_from("<IQ", self._mm, pos)
            pos += 12
            if itype in _NP_TYPES:  # numeric arrays in one frombuffer
                dtype = np.dtype(_NP_TYPES[itype])
                values = np.frombuffer(self._mm, dtype=dtype, count=count, offset=pos).tolist()
                return values, pos + dtype.itemsize * count
            items = []
            for _ in range(count):
                item, pos = self._value(itype, pos)
                items.append(item)
            return items, pos
        raise ValueError(f"unknown GGUF value type {vtype}")
