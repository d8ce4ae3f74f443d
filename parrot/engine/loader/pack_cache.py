"""The packed quantized weights of a GGUF, kept on disk and mapped (no torch until a tensor is made): the second load
of a model reads none of the file's matrices and packs nothing, and every engine process of the machine shares one
copy of the packed weights in the page cache.

    <dir>/<key>.qpk      dir: EngineSettings.pack_cache_dir, default $XDG_CACHE_HOME/parrot/packed
    key = sha1 of the GGUF's real path, size and mtime, the kernel library's build (its sources' hash: the packed
          layout's version) and the load's weight rule (dtype, weight_quant, act-independent)

    file:  b"PQPK0001" | u64 index length | index (JSON: {"meta": {...}, "entries": {name: [offset, nbytes]}}) |
           packed tensors, 64-aligned

A load looks each matmul up by name (:meth:`PackCache.get`); whatever it had to pack it hands back (:meth:`put`), and
:meth:`save` writes a complete file when the load packed anything (atomically: a temp file, then a rename), removing
the files of earlier versions of the same GGUF and rule (another kernel build, a rewritten file). A file that cannot
be read or written is logged and ignored: the cache only ever saves work.
"""

from __future__ import annotations

import hashlib
import json
import logging
import mmap
import os
import struct
import tempfile
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

MAGIC = b"PQPK0001"
ALIGN = 64


def default_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "parrot" / "packed"


def cache_key(gguf_path: str, library: str, rule: str) -> str:
    """The key of a GGUF's packed weights: its identity on disk, the kernel build (``library``: the compiled
    library's name, which carries its sources' hash) and the load's weight rule."""
    st = os.stat(gguf_path)
    ident = f"{os.path.realpath(gguf_path)}|{st.st_size}|{st.st_mtime_ns}|{library}|{rule}"
    return hashlib.sha1(ident.encode()).hexdigest()[:20]


def for_model(directory: str | Path, gguf_path: str, library: str, rule: str) -> PackCache:
    """The cache of ``gguf_path``'s packed weights under ``rule`` in ``directory``."""
    meta = {"gguf": os.path.realpath(gguf_path), "rule": rule}
    return PackCache(Path(directory) / f"{cache_key(gguf_path, library, rule)}.qpk", meta)


def _read_index(mm) -> dict:
    if mm[:8] != MAGIC:
        raise ValueError("bad magic")
    (n,) = struct.unpack_from("<Q", mm, 8)
    return json.loads(bytes(mm[16:16 + n]))


class PackCache:
    """One model's packed weights on disk (see the module docstring); ``meta`` names the GGUF and rule they are of."""

    def __init__(self, path: Path, meta: dict | None = None) -> None:
        self.path = path
        self.meta = meta or {}
        self._index: dict[str, tuple[int, int]] = {}
        self._mm: mmap.mmap | None = None
        self._new: dict[str, Any] = {}
        self.hits = 0
        self._open()

    def _open(self) -> None:
        try:
            with open(self.path, "rb") as f:
                mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)  # private: torch may view it, nothing writes
        except (FileNotFoundError, ValueError):
            return  # absent (or empty)
        except OSError as e:
            log.warning("packed-weight cache %s unreadable (%s); packing from the file", self.path, e)
            return
        try:
            index = _read_index(mm)["entries"]
            if any(off + size > len(mm) for off, size in index.values()):
                raise ValueError("truncated")
        except (ValueError, KeyError, TypeError, struct.error, json.JSONDecodeError) as e:
            log.warning("packed-weight cache %s is corrupt (%s); packing from the file", self.path, e)
            mm.close()
            return
        self._mm, self._index = mm, {k: (int(o), int(s)) for k, (o, s) in index.items()}

    def get(self, name: str):
        """The packed tensor stored under ``name`` (a uint8 view of the mapped file), or None."""
        if self._mm is None or name not in self._index:
            return None
        import torch

        off, size = self._index[name]
        self.hits += 1
        return torch.frombuffer(self._mm, dtype=torch.uint8, count=size, offset=off)

    def put(self, name: str, packed) -> None:
        """A tensor the load had to pack (written by :meth:`save`)."""
        self._new[name] = packed

    def save(self) -> None:
        """Write every tensor of this load (the ones found and the new ones) when anything was new."""
        if not self._new:
            return
        entries = {**{k: self.get(k) for k in self._index if k not in self._new}, **self._new}
        header, prev = b"", None
        while header != prev:  # the index's own length moves the data behind it: settle it
            prev, pos, index, layout = header, -(-(16 + len(header)) // ALIGN) * ALIGN, {}, []
            for name, t in entries.items():
                index[name] = [pos, t.numel()]
                layout.append((pos, t))
                pos = -(-(pos + t.numel()) // ALIGN) * ALIGN
            header = json.dumps({"meta": self.meta, "entries": index}).encode()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, suffix=".part")
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(MAGIC + struct.pack("<Q", len(header)) + header)
                    for off, t in layout:
                        f.seek(off)
                        f.write(memoryview(t.contiguous().numpy()).cast("B"))
                    f.truncate(pos)
                os.replace(tmp, self.path)
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
        except OSError as e:
            log.warning("could not write the packed-weight cache %s (%s); the next load packs again", self.path, e)
            return
        log.info("packed weights cached in %s (%.0f MiB)", self.path, pos / 2**20)
        self._remove_stale()

    def _remove_stale(self) -> None:
        """Delete this directory's other files of the same GGUF and rule (an older kernel build or file version)."""
        if not self.meta:
            return
        for other in self.path.parent.glob("*.qpk"):
            if other == self.path:
                continue
            try:
                with open(other, "rb") as f:
                    head = f.read(16)
                    if head[:8] != MAGIC:
                        continue
                    meta = json.loads(f.read(struct.unpack_from("<Q", head, 8)[0])).get("meta")
                if meta == self.meta:
                    other.unlink()
                    log.info("removed the stale packed-weight cache %s", other)
            except (OSError, ValueError, struct.error):
                continue
