"""Read the records of an offline W&B run file (``run-*.wandb``) without network or wandb-core.

The file is a LevelDB-style log: a 7-byte header (``:W&B``, magic 0xBEE1, version), then 32 KiB blocks
of chunks, each ``<crc32: u32><length: u16><type: u8><payload>`` with type FULL=1, FIRST=2, MIDDLE=3,
LAST=4; a block's tail shorter than a chunk header is zero padding. The joined payloads are
``wandb.proto.wandb_internal_pb2.Record`` protobufs. (wandb >= 0.18 no longer ships its Python
``DataStore`` reader, so the tests carry this one.)
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from wandb.proto import wandb_internal_pb2

_BLOCK = 32 * 1024
_HEADER = 7


def read_records(path: Path) -> list[wandb_internal_pb2.Record]:
    data = Path(path).read_bytes()
    ident, magic, version = struct.unpack("<4sHB", data[:_HEADER])
    if ident != b":W&B" or magic != 0xBEE1:
        raise ValueError(f"{path} is not a W&B run file (header {data[:_HEADER]!r}).")
    records, pending, pos = [], b"", _HEADER
    while pos + _HEADER <= len(data):
        left_in_block = _BLOCK - pos % _BLOCK
        if left_in_block < _HEADER:
            pos += left_in_block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + _HEADER])
        if kind == 0 and length == 0:
            break
        payload = data[pos + _HEADER : pos + _HEADER + length]
        pos += _HEADER + length
        pending = payload if kind in (1, 2) else pending + payload
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def history_rows(path: Path) -> list[dict]:
    """The ``wandb.log`` rows of a run file, values JSON-decoded."""
    rows = []
    for record in read_records(path):
        if record.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item})
    return rows
