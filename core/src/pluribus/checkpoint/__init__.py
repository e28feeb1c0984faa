"""Distributed checkpoints: sharded save and load into any world size and layout.

Each rank writes its pieces to a safetensors file; the coordinator writes ``metadata.json``
(global shapes, dtypes, each chunk's file and a CRC-32 per block) last and renames the folder
into place, so a checkpoint is complete or absent. Loading computes each rank's reads from the
metadata alone and verifies what it reads. Nothing is pickled. See ``docs/checkpoint.md``.
"""

from ..dtensor.boxes import Pieces
from .consolidate import consolidate, read_whole
from .errors import CheckpointError
from .load import load
from .manager import CheckpointManager
from .metadata import VERSION, read_metadata
from .save import SaveFuture, async_save, save

__all__ = [
    "VERSION",
    "CheckpointError",
    "CheckpointManager",
    "Pieces",
    "SaveFuture",
    "async_save",
    "consolidate",
    "load",
    "read_metadata",
    "read_whole",
    "save",
]
