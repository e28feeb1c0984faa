"""The checkpoint's table of contents, ``metadata.json``: what each key is and where its bytes
are. Plain JSON, so loading a checkpoint never runs code; written last, so a directory without
it is not a checkpoint.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

from .errors import CheckpointError

FORMAT = "pluribus-checkpoint"
VERSION = 1
METADATA_FILE = "metadata.json"
#: bytes covered by one checksum; a rank that reads part of a chunk verifies only the blocks it
#: reads
BLOCK_BYTES = 4 << 20


@dataclass(frozen=True)
class Chunk:
    """One box of a tensor, stored as tensor ``name`` of safetensors ``file``."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str
    name: str
    checksums: tuple[int, ...]

    def to_json(self) -> dict:
        return {
            "offsets": list(self.offsets),
            "sizes": list(self.sizes),
            "file": self.file,
            "name": self.name,
            "checksums": list(self.checksums),
        }

    @staticmethod
    def from_json(d: dict) -> Chunk:
        return Chunk(
            tuple(d["offsets"]), tuple(d["sizes"]), d["file"], d["name"], tuple(d["checksums"])
        )


@dataclass
class TensorInfo:
    """A tensor's global shape and dtype, the layout it was saved from (for people), and its
    chunks, which tile the global shape exactly once."""

    shape: tuple[int, ...]
    dtype: str
    saved_layout: str
    chunks: list[Chunk] = field(default_factory=list)

    def to_json(self) -> dict:
        return {
            "shape": list(self.shape),
            "dtype": self.dtype,
            "saved_layout": self.saved_layout,
            "chunks": [c.to_json() for c in self.chunks],
        }

    @staticmethod
    def from_json(d: dict) -> TensorInfo:
        return TensorInfo(
            tuple(d["shape"]),
            d["dtype"],
            d.get("saved_layout", ""),
            [Chunk.from_json(c) for c in d["chunks"]],
        )

    @property
    def nbytes(self) -> int:
        from .safetensors_io import numpy_dtype

        return math.prod(self.shape) * numpy_dtype(self.dtype).itemsize


@dataclass
class Metadata:
    world_size: int
    tensors: dict[str, TensorInfo]
    #: plain values every rank agreed on
    values: dict[str, Any]
    #: plain values that differed between ranks: one per saving rank
    rank_values: dict[str, list[Any]]
    block_bytes: int = BLOCK_BYTES
    checksum: str = "crc32"

    def to_json(self) -> str:
        return json.dumps(
            {
                "format": FORMAT,
                "version": VERSION,
                "world_size": self.world_size,
                "block_bytes": self.block_bytes,
                "checksum": self.checksum,
                "tensors": {k: t.to_json() for k, t in self.tensors.items()},
                "values": self.values,
                "rank_values": self.rank_values,
            },
            indent=1,
        )

    @property
    def keys(self) -> set[str]:
        return set(self.tensors) | set(self.values) | set(self.rank_values)


def read_metadata(path: str | os.PathLike) -> Metadata:
    """Parse ``path/metadata.json``; a missing file, another format or a newer version raise
    :class:`CheckpointError` saying what to do."""
    file = os.path.join(os.fspath(path), METADATA_FILE)
    try:
        with open(file, encoding="utf-8") as f:
            doc = json.load(f)
    except FileNotFoundError:
        where = "no such directory" if not os.path.isdir(path) else f"no {METADATA_FILE} in it"
        raise CheckpointError(
            f"{os.fspath(path)} is not a checkpoint ({where}); a save that did not finish "
            "leaves only a .tmp- directory, which is never loaded"
        ) from None
    except ValueError as e:
        raise CheckpointError(f"{file}: not valid JSON ({e})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise CheckpointError(f"{file}: not a {FORMAT} metadata file")
    version = doc.get("version")
    if not isinstance(version, int) or version > VERSION:
        raise CheckpointError(
            f"{file}: format version {version!r} is newer than this pluribus reads "
            f"(version {VERSION}); upgrade pluribus to load it"
        )
    try:
        return Metadata(
            world_size=int(doc["world_size"]),
            tensors={k: TensorInfo.from_json(t) for k, t in doc["tensors"].items()},
            values=dict(doc["values"]),
            rank_values={k: list(v) for k, v in doc["rank_values"].items()},
            block_bytes=int(doc["block_bytes"]),
            checksum=str(doc["checksum"]),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{file}: malformed metadata ({type(e).__name__}: {e})") from None
