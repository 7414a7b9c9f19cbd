"""Builds the exporter's registry from the roster and the command-line settings.

All source collectors hang under one `FleetCollector`, which runs them in turn under a
supervisor: a collector that raises loses only its own series (and what it yielded before the
error is kept), its success and duration are recorded, and families that several collectors
emit (`gpufleet_gpu_info` from NVIDIA and AMD alike) are merged into one, because the text
format allows a family's HELP and TYPE only once.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric

from exporter.canary import CanaryCollector
from exporter.collectors.amd import AmdCollector
from exporter.collectors.base import CollectorError, GpuCollector, SourceCollector
from exporter.collectors.host import HostCollector
from exporter.collectors.hwmon import HwmonCollector
from exporter.collectors.llama import LlamaCollector
from exporter.collectors.nvidia import NvidiaCollector
from exporter.collectors.ports import PortsCollector
from exporter.collectors.selfstats import CollectorOutcome, self_metrics
from exporter.collectors.server_memory import ServerMemoryCollector
from exporter.collectors.units import UnitsCollector
from exporter.collectors.vllm import VllmCollector
from exporter.sources.nvml import load_backend
from exporter.sources.pci import number_host_gpus
from exporter.sources.systemd import UnitsReader
from fleet.gpu_index import GpuIndex
from fleet.roster import Host

log = logging.getLogger(__name__)

UNRENDERABLE = "unrenderable"
"""The `reason` of series dropped because a label value cannot be written as UTF-8."""


@dataclass(frozen=True)
class ExporterSettings:
    """Everything the exporter's collectors are built from; production defaults here only."""

    host: Host | None = None  # this host's roster entry; None when there is no roster
    sysfs: str = "/sys"
    procfs: str = "/proc"
    nvml_fake_scenario: Path | None = None  # a stand-in for a GPU, for tests and demos
    collector_timeout_seconds: float = 4.0


class FleetCollector:
    """Runs every source collector, merges their families, and adds the exporter's own."""

    def __init__(
        self,
        collectors: Sequence[SourceCollector],
        *,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.collectors = list(collectors)
        self._clock = clock
        # One scrape at a time: collectors keep per-scrape state (CPU deltas, NVML's worker),
        # and two scrapers at once must not double the load on a struggling GPU.
        self._lock = threading.Lock()
        self._last_error: dict[str, str] = {}
        # Every collector's dropped count from the start, so that the first drop is an increase.
        self._dropped: dict[tuple[str, str], int] = {
            (c.name, UNRENDERABLE): 0 for c in self.collectors
        }
        self._dropped_lock = threading.Lock()
        remote = [c for c in self.collectors if getattr(c, "reads_network", False)]
        self._pool = (
            concurrent.futures.ThreadPoolExecutor(len(remote), thread_name_prefix="collect")
            if remote
            else None
        )

    def collect(self) -> Iterator[Metric]:
        """One scrape: every collector's families, merged by name, then the self metrics."""
        with self._lock:
            # Collectors that wait on the network (model servers) run beside the local ones,
            # so a slow server costs its own timeout once, not on top of NVML's deadline.
            remote = {
                c.name: self._pool.submit(self._run, c)
                for c in self.collectors
                if self._pool is not None and getattr(c, "reads_network", False)
            }
            results = [
                remote[c.name].result() if c.name in remote else self._run(c)
                for c in self.collectors
            ]
        merged: dict[str, Metric] = {}
        outcomes = []
        for families, outcome in results:
            for family in families:
                _merge(merged, family)
            outcomes.append(outcome)
        yield from merged.values()
        with self._dropped_lock:
            dropped = dict(self._dropped)
        yield from self_metrics(outcomes, dropped)

    def _run(self, collector: SourceCollector) -> tuple[list[Metric], CollectorOutcome]:
        start = self._clock()
        families: list[Metric] = []
        success = True
        error = ""
        try:
            families.extend(collector.collect())
        except CollectorError as exc:
            success, error = False, str(exc)
        except Exception as exc:
            success, error = False, f"{type(exc).__name__}: {exc}"
            log.exception("collector %s crashed", collector.name)
        families, bad = _renderable(families)
        if bad:
            success = False
            left_out = f"left out, not writable as UTF-8 text: {', '.join(sorted(bad))}"
            error = f"{error}; {left_out}" if error else left_out
            with self._dropped_lock:
                key = (collector.name, UNRENDERABLE)
                self._dropped[key] = self._dropped.get(key, 0) + sum(bad.values())
        duration = self._clock() - start
        self._log_change(collector.name, error)
        return families, CollectorOutcome(collector.name, success, duration)

    def _log_change(self, name: str, error: str) -> None:
        # Log a collector's error when it appears or changes, and its recovery, not every
        # scrape: a lost GPU would otherwise write a line every 15 s for days.
        previous = self._last_error.get(name, "")
        if error and error != previous:
            log.warning("collector %s failed: %s", name, error)
        elif not error and previous:
            log.info("collector %s recovered", name)
        self._last_error[name] = error

    def close(self) -> None:
        """Close every collector (NVML shutdown, threads), each even if another fails."""
        for collector in self.collectors:
            try:
                collector.close()
            except Exception:
                log.exception("closing collector %s failed", collector.name)
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


def _renderable(families: list[Metric]) -> tuple[list[Metric], dict[str, int]]:
    """The families whose label values can be written as text, and the others' sample counts.

    Sources clean their strings where they read them (`exporter.sources.text`); this is the
    net under that: one value that cannot be encoded (a lone surrogate) must cost its family
    and its collector, not fail the exposition of the whole host.
    """
    kept: list[Metric] = []
    bad: dict[str, int] = {}
    for family in families:
        try:
            for sample in family.samples:
                for value in sample.labels.values():
                    if not value.isascii():  # ASCII always encodes; checked in C
                        value.encode()
        except (UnicodeEncodeError, AttributeError):  # AttributeError: not a str at all
            bad[family.name] = bad.get(family.name, 0) + len(family.samples)
            continue
        kept.append(family)
    return kept, bad


def _merge(merged: dict[str, Metric], family: Metric) -> None:
    existing = merged.get(family.name)
    if existing is None:
        merged[family.name] = family
        return
    if existing.type != family.type:
        # A bug between two collectors; keep the first and say so rather than break the text.
        log.error("family %s emitted as %s and as %s", family.name, existing.type, family.type)
        return
    existing.samples.extend(family.samples)


def build_collectors(settings: ExporterSettings) -> list[SourceCollector]:
    """The source collectors for this host, with `gpu` indices assigned in PCI bus order."""
    host = settings.host
    expected_nvidia = expected_amd = None
    compute_mode = None
    thermal: dict[str, float] = {}
    if host is not None:
        # With a roster, a vendor it does not name is expected to be absent (count 0).
        expected_nvidia = host.gpus.nvidia.count if host.gpus.nvidia else 0
        expected_amd = host.gpus.amd.count if host.gpus.amd else 0
        compute_mode = host.gpus.nvidia.compute_mode if host.gpus.nvidia else None
        thermal = host.thermal_criticals()
    gpu_index = GpuIndex()
    nvidia = NvidiaCollector(
        load_backend(settings.nvml_fake_scenario),
        gpu_index=gpu_index,
        expected_count=expected_nvidia,
        expected_compute_mode=compute_mode,
        timeout_seconds=settings.collector_timeout_seconds,
    )
    amd = AmdCollector(
        settings.sysfs,
        gpu_index=gpu_index,
        expected_count=expected_amd,
        timeout_seconds=settings.collector_timeout_seconds,
    )
    gpu_collectors: list[GpuCollector] = [nvidia, amd]
    # The host's numbering, as gpu-fleet-node makes it: PCI sysfs and the roster's bus ids,
    # so an NVML slower than its deadline at start (or blind to a card) moves no index.
    number_host_gpus(
        gpu_index,
        sysfs=settings.sysfs,
        expected=host.gpus.expected_pci_bus_ids() if host is not None else (),
        found=[bus_id for c in gpu_collectors for bus_id in c.pci_bus_ids()],
    )
    collectors: list[SourceCollector] = [
        nvidia,
        amd,
        HwmonCollector(settings.sysfs, thermal=thermal, procfs=settings.procfs),
        HostCollector(),
    ]
    servers = host.servers if host is not None else {}
    if servers:
        # One `systemctl show` per scrape for every collector that needs the units.
        units = UnitsReader([s.unit for s in servers.values()])
        collectors.append(UnitsCollector(servers, units, procfs=settings.procfs))
        collectors.append(
            PortsCollector(servers, units, procfs=settings.procfs, sysfs=settings.sysfs)
        )
        collectors.append(
            ServerMemoryCollector(
                servers,
                units,
                nvidia=nvidia,
                amd_bus_ids=amd.pci_bus_ids,
                gpu_index=gpu_index,
                procfs=settings.procfs,
                sysfs=settings.sysfs,
            )
        )
    if any(s.engine == "llama" for s in servers.values()):
        collectors.append(LlamaCollector(servers))
    if any(s.engine == "vllm" for s in servers.values()):
        collectors.append(VllmCollector(servers))
    if any(s.canary is not None for s in servers.values()):
        collectors.append(CanaryCollector(servers))
    return collectors


def build_registry(settings: ExporterSettings) -> tuple[CollectorRegistry, FleetCollector]:
    """A fresh registry holding the fleet collector (and nothing of prometheus_client's)."""
    fleet = FleetCollector(build_collectors(settings))
    registry = CollectorRegistry(auto_describe=False)
    registry.register(fleet)
    return registry, fleet
