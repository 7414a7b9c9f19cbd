"""The whole exporter over fixtures: the catalogue's families, the text writer, a mixed-vendor host.

The scrape here is the real registry (`build_registry`) over a sysfs fixture tree with an AMD
iGPU and a discrete AMD card beside two NVIDIA GPUs from the fake NVML backend (the stand-in
for a GPU), with the roster's expectations and thermal limits.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from exporter.canary import CanaryCollector
from exporter.collectors.catalogue import CATALOGUE
from exporter.exposition import TextWriter
from exporter.registry import ExporterSettings, FleetCollector, build_registry
from fleet.roster import Host
from tests.golden import assert_golden
from tests.llama_lab import StartLlamaServer, wait_until
from tests.sysfs_tree import (
    apu_spec,
    discrete_spec,
    nvme_spec,
    write_amd_card,
    write_hwmon_chip,
    write_k10temp,
)
from tests.systemctl_stand_in import SystemctlStandIn
from tests.ttar import extract
from tests.vllm_stand_in import VllmStandIn

REPO = Path(__file__).resolve().parent.parent
TWO_GPUS = REPO / "tests" / "fixtures" / "nvml" / "two_gpus.yaml"

HOST = {
    "address": "127.0.0.1",
    "gpus": {"nvidia": {"count": 2, "compute_mode": "exclusive_process"}, "amd": {"count": 2}},
    "thermal": {"k10temp/Tctl": {"critical_celsius": 95}},
}

# Series whose values move on their own (psutil's view of this machine, timings, versions).
VOLATILE = re.compile(
    r"^gpufleet_(host_(cpu|load|memory|swap)\w*|exporter_collector_duration_seconds"
    r"|exporter_build_info)[{ ]"
)


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[tuple[CollectorRegistry, FleetCollector]]:
    sysfs = tmp_path / "sys"
    # NVIDIA at 0x41 and 0xc1 (the scenario), a discrete AMD card at 0x03, the iGPU at 0xc5.
    write_amd_card(sysfs, replace(discrete_spec(0, "0000:03:00.0"), energy=1_234_000_000))
    write_amd_card(sysfs, apu_spec(1, "0000:c5:00.0"))
    write_k10temp(sysfs)
    write_hwmon_chip(sysfs, nvme_spec(0, "0000:01:00.0"))
    host = Host.model_validate(HOST)
    settings = ExporterSettings(host=host, sysfs=str(sysfs), nvml_fake_scenario=TWO_GPUS)
    registry, collector = build_registry(settings)
    yield registry, collector
    collector.close()


def live_host(llama_url: str, vllm_url: str, *, canary: bool) -> Host:
    """HOST with its servers: llama-server `alpha` (with a canary, if asked) and vLLM `zeta`.

    The live scrape here and the dashboard test's (tests/test_dashboards.py) share it.
    """
    alpha: dict[str, object] = {
        "engine": "llama",
        "url": llama_url,
        "unit": "llama-server@alpha.service",
        "role": "gpu-dense",
        "model": "tiny",
        "gpu": 0,
    }
    if canary:
        alpha["canary"] = {"interval_seconds": 3600, "max_tokens": 8}
    zeta = {
        "engine": "vllm",
        "url": vllm_url,
        "unit": "vllm@zeta.service",
        "role": "gpu-vision",
        "model": "Qwen3-VL-8B",
    }
    return Host.model_validate({**HOST, "servers": {"alpha": alpha, "zeta": zeta}})


def scrape_when_xids_arrived(registry: CollectorRegistry) -> str:
    # Xid events reach the collector through NVML's event thread: wait for them (bounded).
    deadline = time.monotonic() + 10
    text = ""
    while time.monotonic() < deadline:
        text = TextWriter().render_registry(registry).decode()
        if 'gpufleet_gpu_xid_errors_total{gpu="2",xid="31"}' in text:
            return text
        time.sleep(0.05)
    raise AssertionError("the scenario's Xid events never showed:\n" + text)


def assert_unique_series(text: str) -> None:
    """No two samples of the exposition share a name and label set (Prometheus would keep one
    of them, silently; promtool does not mind)."""
    seen: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    duplicates = []
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = (sample.name, tuple(sorted(sample.labels.items())))
            if key in seen:
                duplicates.append(key)
            seen[key] = sample.value
    assert not duplicates, f"samples sharing a label set: {duplicates}"
    assert seen, "an empty exposition proves nothing"


def promtool_check(text: str) -> None:
    promtool = shutil.which("promtool")
    assert promtool is not None, "promtool is missing: `make test` installs it"
    check = subprocess.run(
        [promtool, "check", "metrics"], input=text, capture_output=True, text=True, check=False
    )
    assert check.returncode == 0, check.stdout + check.stderr


def test_every_collector_makes_its_families_from_the_catalogue() -> None:
    """No collector builds a metric family of its own: help texts and labels cannot drift."""
    offenders = [
        f"{path.relative_to(REPO)}:{number}"
        for path in sorted((REPO / "exporter").rglob("*.py"))
        if path.name not in ("catalogue.py", "exposition.py")
        for number, line in enumerate(path.read_text().splitlines(), start=1)
        if re.search(r"\b(Gauge|Counter|Histogram)MetricFamily\(", line)
    ]
    assert offenders == []
    units = {f.unit for f in CATALOGUE.values()}
    assert {"bytes", "celsius", "watts", "joules", "hertz", "seconds", "ratio", "rpm", ""} == units
    assert CATALOGUE["gpufleet_gpu_energy_joules_total"].unit == "joules"
    assert CATALOGUE["gpufleet_llama_slots"].unit == ""


def assert_families_match_the_catalogue(text: str) -> None:
    """Each family of a scrape has the catalogue's type, help text and label names."""
    for family in text_string_to_metric_families(text):
        name = family.name + "_total" if family.type == "counter" else family.name
        spec = CATALOGUE[name]
        assert (family.type, family.documentation) == (spec.type, spec.help), name
        for sample in family.samples:
            labels = set(sample.labels) - {"le"}  # a histogram bucket's bound
            assert labels == set(spec.labels), (name, sample.labels)


def test_the_catalogue_lists_exactly_the_series_the_exporter_produces(
    tmp_path: Path, llama_server: StartLlamaServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Everything at once: GPUs of both vendors, host chips, a real llama-server generating on
    # one of its two slots (with its canary), a vLLM stand-in (vLLM cannot run here), and
    # their units through the systemctl stand-in (systemd is not PID 1 here).
    sysfs = tmp_path / "sys"
    write_amd_card(sysfs, replace(discrete_spec(0, "0000:03:00.0"), energy=1_234_000_000))
    write_k10temp(sysfs)
    llama = llama_server("-c", "65536", "-np", "2", "-t", "1", "-a", "tiny", "--metrics")
    llama.generate(n_predict=30000)
    systemctl = SystemctlStandIn(tmp_path)
    systemctl.activate(monkeypatch)
    systemctl.set_unit(
        "llama-server@alpha.service",
        ActiveState="active",
        SubState="running",
        MainPID=llama.pid,
        NRestarts=2,
        StateChangeTimestampMonotonic=int(time.monotonic() * 1e6) - 5_000_000,
    )
    # The vLLM stand-in listens in this very process.
    systemctl.set_unit("vllm@zeta.service", ActiveState="active", MainPID=os.getpid())
    with VllmStandIn(REPO / "tests" / "fixtures" / "vllm" / "metrics-v1.txt") as vllm:
        host = live_host(llama.url, vllm.url, canary=True)
        settings = ExporterSettings(host=host, sysfs=str(sysfs), nvml_fake_scenario=TWO_GPUS)
        registry, fleet = build_registry(settings)
        try:
            # The canary's first run would wait for its schedule: run it now.
            canaries = [c for c in fleet.collectors if isinstance(c, CanaryCollector)]
            assert [p.run_once() for c in canaries for p in c.probes] == ["ok"]
            wait_until(
                lambda: (
                    b"gpufleet_llama_slot_decoded_tokens" in TextWriter().render_registry(registry)
                ),
                timeout=20,
                what="a busy slot",
            )
            text = scrape_when_xids_arrived(registry)
        finally:
            fleet.close()
    produced = {
        line.split("{", 1)[0].split(" ", 1)[0]
        for line in text.splitlines()
        if line and not line.startswith("#")
    }
    # A histogram's samples are listed under the family's name.
    produced = {re.sub(r"_(bucket|sum|count)$", "", n) if "_seconds_" in n else n for n in produced}
    # The catalogue is what docs/metrics.md is generated from (tests/test_docs.py).
    documented = set(CATALOGUE)
    assert_families_match_the_catalogue(text)
    assert produced - documented == set(), "produced but not in the catalogue"
    # Router mode's families need a router (llama-server --models-dir): the router test
    # (tests/test_llama_router.py) produces them and checks them against the catalogue.
    router_only = {f"gpufleet_llama_model_{n}" for n in ("info", "state", "exit_code")}
    assert documented - produced - router_only == set(), "in the catalogue but not produced"
    promtool_check(text)


def test_mixed_vendor_host_golden_and_indices(
    fleet: tuple[CollectorRegistry, FleetCollector],
) -> None:
    registry, _ = fleet
    text = scrape_when_xids_arrived(registry)
    stable = "".join(line + "\n" for line in text.splitlines() if not VOLATILE.match(line))
    assert_golden(stable, "exporter_amd_igpu_beside_nvidia")
    # `gpu` in PCI bus order across vendors: AMD 0x03, NVIDIA 0x41 and 0xc1, AMD iGPU 0xc5.
    info = {
        m.group(2): m.group(1)
        for m in re.finditer(r'gpufleet_gpu_info\{[^}]*gpu="(\d)",[^}]*pci_bus_id="([^"]+)"', text)
    }
    assert info == {
        "0000:03:00.0": "0",
        "0000:41:00.0": "1",
        "0000:c1:00.0": "2",
        "0000:c5:00.0": "3",
    }
    for collector in ("nvidia", "amd", "hwmon", "host"):
        assert f'gpufleet_exporter_collector_success{{collector="{collector}"}} 1.0' in text
    roster_crit = 'chip="k10temp",sensor="Tctl",source="roster"} 95.0'
    assert f"gpufleet_host_temperature_critical_celsius{{{roster_crit}" in text
    assert_unique_series(text)
    promtool_check(text)


def test_text_writer_matches_prometheus_client_byte_for_byte(
    fleet: tuple[CollectorRegistry, FleetCollector],
) -> None:
    _, collector = fleet
    families = list(collector.collect())
    ours = TextWriter().render(families).decode()

    class Replay:
        def collect(self) -> list[Metric]:
            return families

    reference = CollectorRegistry(auto_describe=False)
    reference.register(Replay())
    assert ours == generate_latest(reference).decode()
    assert len(ours.splitlines()) > 200


def test_text_writer_escapes_and_falls_back() -> None:
    odd = GaugeMetricFamily("x_info", "help with \\ and\nnewline", labels=["v"])
    odd.add_metric(['a"b\\c\nd'], 1.0)
    inf = GaugeMetricFamily("x_inf", "infinite", labels=[])
    inf.add_metric([], float("inf"))
    writer = TextWriter()
    text = writer.render([odd, inf]).decode()
    assert text == (
        "# HELP x_info help with \\\\ and\\nnewline\n# TYPE x_info gauge\n"
        'x_info{v="a\\"b\\\\c\\nd"} 1.0\n'
        "# HELP x_inf infinite\n# TYPE x_inf gauge\nx_inf +Inf\n"
    )
    assert writer.render([odd, inf]).decode() == text  # from remembered heads
    histogram = HistogramMetricFamily(
        "x_seconds", "h", buckets=[("1.0", 1), ("+Inf", 2)], sum_value=3
    )
    assert b'x_seconds_bucket{le="1.0"} 1.0' in writer.render([histogram])


FIXTURE_TREES = REPO / "tests" / "fixtures" / "sysfs"


@pytest.mark.parametrize(
    ("archive", "root"),
    [
        # node_exporter's collector/fixtures/sys.ttar (hwmon part): hwmon4 has two channels
        # labelled `foosensor`, coretemp.0 and coretemp.1 share a chip name and all labels.
        ("node_exporter_hwmon.ttar", "sys"),
        # prometheus/procfs testdata/fixtures.ttar (class/drm): a Vega card0 (amdgpu) beside
        # an i915 card1.
        ("procfs_vega.ttar", "fixtures/sys"),
    ],
)
def test_no_scrape_of_real_captures_has_two_samples_with_one_label_set(
    tmp_path: Path, archive: str, root: str
) -> None:
    extract(FIXTURE_TREES / archive, tmp_path)
    host = Host.model_validate({"address": "127.0.0.1", "gpus": {"amd": {"count": 1}}})
    settings = ExporterSettings(host=host, sysfs=str(tmp_path / root))
    registry, collector = build_registry(settings)
    try:
        text = TextWriter().render_registry(registry).decode()
        assert_unique_series(text)
        promtool_check(text)
    finally:
        collector.close()
    if archive == "node_exporter_hwmon.ttar":
        for line in (
            'gpufleet_host_temperature_celsius{chip="hwmon4",sensor="foosensor"} 55.0',
            'gpufleet_host_temperature_celsius{chip="hwmon4",sensor="foosensor_temp2"} 54.0',
            'gpufleet_host_temperature_celsius{chip="coretemp_1",sensor="Core 0"}',
        ):
            assert line in text
    else:
        assert 'gpufleet_gpu_up{gpu="0"} 1.0' in text
        assert 'vendor="amd"' in text and 'card="card0"' in text
