"""Fast, forgiving readers of sysfs attribute files.

Every scrape reads a few hundred of these files (amdgpu, hwmon), so a read is one
`open`/`read`/`close` syscall sequence on a raw descriptor — no Python file object, no
decoding unless text is asked for. A reader never raises: a missing file, a read error
(amdgpu answers EPERM while the GPU is in runtime suspend or reset, EOPNOTSUPP for an
attribute the ASIC lacks), empty content or content that does not parse all give `None`, and
the caller drops that one field.

`StaticValue` holds a value that does not change while the device exists (a VRAM total, a
critical temperature, a VBIOS version): read once, re-read only while still unknown.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")

# A sysfs `show()` fills at most one page (Documentation/filesystems/sysfs.rst: "sysfs
# allocates a buffer of size (PAGE_SIZE)"), so one read of a page returns the whole attribute.
_CHUNK = 4096
_FLAGS = os.O_RDONLY | os.O_CLOEXEC


def read_bytes(path: str) -> bytes | None:
    """The file's raw content, or None when it cannot be opened or read."""
    try:
        fd = os.open(path, _FLAGS)
    except OSError:
        return None
    try:
        data = os.read(fd, _CHUNK)
        # Only a non-sysfs file (a fixture) or a 64 KiB-page kernel can have more.
        if len(data) == _CHUNK:
            parts = [data]
            while chunk := os.read(fd, _CHUNK):
                parts.append(chunk)
            data = b"".join(parts)
    except OSError:
        return None
    finally:
        os.close(fd)
    return data


def read_text(path: str) -> str | None:
    """The file's content stripped of surrounding whitespace; None if missing, empty or binary.

    Binary means not UTF-8 or holding a NUL byte: sysfs text attributes never do.
    """
    data = read_bytes(path)
    if not data or b"\0" in data:
        return None
    try:
        text = data.decode().strip()
    except UnicodeDecodeError:
        return None
    return text or None


def read_int(path: str, base: int = 10) -> int | None:
    """The file's content as an integer (surrounding whitespace allowed); None if unreadable.

    With `base=16` a `0x` prefix is accepted, as in the PCI `vendor`/`device` files (`0x1002`).
    """
    data = read_bytes(path)
    # int() also takes Python's digit separators (b"4_2000" is 42000): the kernel never writes
    # one, so a file holding one is garbage, not a value.
    if data is None or b"_" in data:
        return None
    try:
        # int() takes bytes and ignores surrounding whitespace: no decode, no strip.
        value = int(data, base)
    except ValueError:
        return None
    # The kernel's attributes are at most 64-bit; a longer number is garbage, and one past a
    # float's range would break the exposition (every sample is rendered as a float).
    return value if -(2**63) <= value < 2**64 else None


def read_float(path: str) -> float | None:
    """The file's content as a finite float; None if missing, empty, garbled, NaN or infinite."""
    data = read_bytes(path)
    if data is None:
        return None
    try:
        value = float(data)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


class StaticValue(Generic[T]):
    """A value that does not change while its device exists, read from one file.

    Read on first use and cached; while the read fails it is retried on each use (a GPU in
    runtime suspend answers EPERM now and the value later). A `path` of None (the file did
    not exist at discovery) never reads and is always None.
    """

    __slots__ = ("_parse", "_path", "_value")

    def __init__(self, path: str | None, parse: Callable[[str], T | None]) -> None:
        self._path = path
        self._parse = parse
        self._value: T | None = None

    @property
    def exists(self) -> bool:
        """Whether the file existed at discovery (so the value may become known)."""
        return self._path is not None

    def get(self) -> T | None:
        """The cached value, reading the file while it is still unknown."""
        if self._value is None and self._path is not None:
            self._value = self._parse(self._path)
        return self._value
