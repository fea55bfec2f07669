"""What a GGUF model file declares that the proxy starts its llama-server by: its attention's
sliding window.

Only the file's metadata is read (gguf.GGUFReader parses every array and tensor record of the
file, seconds on a large vocabulary). The layout (gguf-py/gguf/constants.py of the pinned
tree): "GGUF", u32 version, u64 tensor count, u64 key count, then per key a string (u64 length,
UTF-8), a u32 value type and the value; an array is a u32 element type, a u64 count and the
elements.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import BinaryIO

GGUF_MAGIC = b"GGUF"
# fixed-size value types by GGUF type number: u8, i8, u16, i16, u32, i32, f32, bool, u64, i64, f64
FIXED_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
INTEGER_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 10: "<Q", 11: "<q"}
STRING, ARRAY = 8, 9


class NotGguf(ValueError):
    """The file is not a GGUF model, or ends inside its metadata."""


def sliding_window(path: Path) -> int:
    """The sliding attention window `path` declares (`<architecture>.attention.sliding_window`),
    0 for none. Raises OSError, or NotGguf for a file that is not one."""
    with open(path, "rb") as file:
        if file.read(4) != GGUF_MAGIC:
            raise NotGguf(f"{path} is not a GGUF file")
        _version, _tensors, keys = struct.unpack("<IQQ", _read(file, 20))
        architecture: str | None = None
        windows: dict[str, int] = {}
        for _ in range(keys):
            key = _string(file)
            value_type = _u32(file)
            if key == "general.architecture" and value_type == STRING:
                architecture = _string(file)
            elif key.endswith(".attention.sliding_window") and value_type in INTEGER_FORMATS:
                windows[key] = _integer(file, value_type)
            else:
                _skip(file, value_type)
        if architecture is None:
            return 0
        return windows.get(f"{architecture}.attention.sliding_window", 0)


def _read(file: BinaryIO, size: int) -> bytes:
    data = file.read(size)
    if len(data) != size:
        raise NotGguf(f"{file.name} ends inside its metadata")
    return data


def _u32(file: BinaryIO) -> int:
    return struct.unpack("<I", _read(file, 4))[0]


def _u64(file: BinaryIO) -> int:
    return struct.unpack("<Q", _read(file, 8))[0]


def _string(file: BinaryIO) -> str:
    return _read(file, _u64(file)).decode("utf-8", "replace")


def _integer(file: BinaryIO, value_type: int) -> int:
    fmt = INTEGER_FORMATS[value_type]
    return struct.unpack(fmt, _read(file, struct.calcsize(fmt)))[0]


def _skip(file: BinaryIO, value_type: int) -> None:
    if value_type in FIXED_SIZES:
        file.seek(FIXED_SIZES[value_type], 1)
    elif value_type == STRING:
        file.seek(_u64(file), 1)
    elif value_type == ARRAY:
        element_type, count = _u32(file), _u64(file)
        if element_type in FIXED_SIZES:
            file.seek(FIXED_SIZES[element_type] * count, 1)
        else:
            for _ in range(count):  # strings (a vocabulary) or nested arrays
                _skip(file, element_type)
    else:
        raise NotGguf(f"{file.name}: unknown metadata value type {value_type}")
