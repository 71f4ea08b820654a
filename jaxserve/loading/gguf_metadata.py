"""A GGUF reader that decodes metadata arrays straight into Python lists.

gguf's GGUFReader keeps every element of an array field as numpy views (two per string): for a 49k-token
vocabulary and its merges, ~200k small arrays, ~160 MB at the peak of opening the file and, once freed,
tens of MB of memory that Python keeps in partly used arenas. Here such arrays never become views;
scalars, strings and the tensor infos are parsed by GGUFReader as before.
"""

from __future__ import annotations

import sys
from typing import Literal

import numpy as np
from gguf import GGUFReader, GGUFValueType


class GGUFMetadataReader(GGUFReader):
    """GGUFReader whose array metadata is in `.arrays` (key -> list) instead of `.fields`."""

    def _build_fields(self, offs: int, count: int) -> int:
        self.arrays: dict = {}
        # numpy's stubs declare ndarray.__buffer__ for Python 3.12+ only; a memmap is a buffer on 3.11 too.
        self._bytes = memoryview(self.data)  # pyright: ignore[reportArgumentType]
        self._int_order: Literal["little", "big"] = (
            "little" if (sys.byteorder == "little") == (self.byte_order == "I") else "big"
        )
        scalar_fields = 0
        for _ in range(count):
            key_length = self._uint(offs, 8)
            key = str(self._bytes[offs + 8 : offs + 8 + key_length], "utf-8")
            value_offs = offs + 8 + key_length
            if self._uint(value_offs, 4) != GGUFValueType.ARRAY:
                offs = super()._build_fields(offs, 1)  # one scalar or string field, as GGUFReader parses it
                scalar_fields += 1
                continue
            if key in self.arrays or key in self.fields:
                raise KeyError(f"Duplicate {key} in the metadata")
            self.arrays[key], offs = self._read_array(value_offs + 4)
        return offs

    def _uint(self, offs: int, size: int) -> int:
        if offs + size > len(self._bytes):
            raise ValueError("the metadata runs past the end of the file")
        return int.from_bytes(self._bytes[offs : offs + size], self._int_order)

    def _read_array(self, offs: int) -> tuple[list, int]:
        item_type, length = GGUFValueType(self._uint(offs, 4)), self._uint(offs + 4, 8)
        offs += 12
        if item_type == GGUFValueType.STRING:
            values = []
            for _ in range(length):
                size = self._uint(offs, 8)
                if offs + 8 + size > len(self._bytes):
                    raise ValueError("a metadata string runs past the end of the file")
                values.append(str(self._bytes[offs + 8 : offs + 8 + size], "utf-8"))
                offs += 8 + size
            return values, offs
        if item_type == GGUFValueType.ARRAY:
            values = []
            for _ in range(length):
                value, offs = self._read_array(offs)  # each element: its own item type and length
                values.append(value)
            return values, offs
        scalar_type = self.gguf_scalar_to_np.get(item_type)
        if scalar_type is None:
            raise ValueError(f"unknown metadata array type {item_type}")
        values = self._get(offs, scalar_type, length)
        if len(values) != length:
            raise ValueError("a metadata array runs past the end of the file")
        return values.tolist(), offs + length * np.dtype(scalar_type).itemsize
