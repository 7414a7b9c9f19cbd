"""Golden exposition files: compare a scrape with `tests/golden/NAME.prom`.

Run with `GPUFLEET_UPDATE_GOLDEN=1` to (re)write the files after an intended change; review the
diff like code.
"""

from __future__ import annotations

import difflib
import os
import re
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.registry import Collector

GOLDEN_DIR = Path(__file__).parent / "golden"


def exposition(*collectors: Collector) -> str:
    """One scrape of the given collectors, alone on a fresh registry, as text."""
    registry = CollectorRegistry(auto_describe=False)
    for collector in collectors:
        registry.register(collector)
    return generate_latest(registry).decode()


# prometheus-client before 0.26 writes large values with a three-digit exponent
# (`1.50754820096e+011`), 0.26 with two (`e+11`), as Go does: the same number to every parser.
# The golden files hold the newest spelling; `make floor` runs these tests on the oldest.
_OLD_EXPONENT = re.compile(r"(?<=[0-9]e\+)0(?=[0-9]{2}\b)")


def assert_golden(text: str, name: str) -> None:
    """Assert that `text` equals the golden file `NAME.prom` (or write it when updating)."""
    path = GOLDEN_DIR / f"{name}.prom"
    text = _OLD_EXPONENT.sub("", text)
    if os.environ.get("GPUFLEET_UPDATE_GOLDEN") == "1":
        GOLDEN_DIR.mkdir(exist_ok=True)
        path.write_text(text)
    assert path.exists(), f"no golden file {path}: run with GPUFLEET_UPDATE_GOLDEN=1"
    expected = path.read_text()
    if text != expected:
        diff = "".join(
            difflib.unified_diff(
                expected.splitlines(keepends=True),
                text.splitlines(keepends=True),
                str(path),
                "scrape",
            )
        )
        raise AssertionError(f"scrape differs from {path}:\n{diff}")
