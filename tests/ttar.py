"""Extract a `ttar` archive: the plain-text tar of Prometheus' fixture trees.

node_exporter (collector/fixtures/sys.ttar) and prometheus/procfs (testdata/fixtures.ttar)
record real sysfs captures in this format (their `ttar` script: records separated by a
`# ttar - - -` line; `Directory: P`, or `Path: P` with `Lines: N` and N lines of content, or
`Path: P` with `SymlinkTo: T`; then `Mode:`). In content, `NULLBYTE` stands for a NUL byte and
a trailing `EOF` marks a file without a final newline; a backslash escapes either word.

    extract(FIXTURES / "node_exporter_hwmon.ttar", tmp_path)   # tmp_path / "sys" / ...
"""

from __future__ import annotations

import os
import re
from pathlib import Path

SEPARATOR = "# ttar - - - - - - - - - - - - - - - - - - - - - - - - - - - - - - - - - - - -"
_NUL = re.compile(r"(?<!\\)NULLBYTE")


def _unescape(line: str) -> tuple[str, bool]:
    """A content line as written, and whether it ended the file without a newline."""
    ends = bool(re.search(r"(?<!\\)EOF$", line))
    if ends:
        line = line[:-3]
    line = _NUL.sub("\0", line).replace(r"\NULLBYTE", "NULLBYTE").replace(r"\EOF", "EOF")
    return line, ends


def extract(archive: Path, root: Path) -> None:
    """Write the archive's directories, files and symlinks under `root`."""
    lines = archive.read_text(encoding="utf-8").split("\n")
    i = 0
    while i < len(lines):
        line = lines[i]
        i += 1
        if line.startswith("Directory: "):
            (root / line[len("Directory: ") :]).mkdir(parents=True, exist_ok=True)
        elif line.startswith("Path: "):
            path = root / line[len("Path: ") :]
            path.parent.mkdir(parents=True, exist_ok=True)
            kind = lines[i]
            i += 1
            if kind.startswith("SymlinkTo: "):
                os.symlink(kind[len("SymlinkTo: ") :], path)
            elif kind.startswith("Lines: "):
                count = int(kind[len("Lines: ") :])
                content = []
                for _ in range(count):
                    text, ends = _unescape(lines[i])
                    i += 1
                    content.append(text if ends else text + "\n")
                path.write_bytes("".join(content).encode("utf-8", "surrogateescape"))
            else:
                raise ValueError(f"{archive}: unknown record for {path}: {kind!r}")
        elif line.startswith("Mode: "):
            continue  # every fixture file is readable; modes do not matter to the readers
        elif line and line != SEPARATOR and not line.startswith("#"):
            raise ValueError(f"{archive}: line {i}: unexpected {line!r}")
