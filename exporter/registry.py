"""Builds the exporter's registry from the roster and the command-line settings.

All source collectors hang under one `FleetCollector`, which runs them under a supervisor,
off the scrape thread (`exporter.sources.deadline`: the local ones in turn, each collector of
model servers beside them), under one deadline for the scrape: Prometheus'
`X-Prometheus-Scrape-Timeout-Seconds` (else 10 s) less 0.5 s (`scrape_budget`). A collector
that raises loses only its own series (and what it yielded before the error is kept); one
that has not finished by the deadline, or is still stuck since an earlier scrape, yields
nothing this scrape and reads `gpufleet_exporter_collector_success 0`, while the scrape
answers on time with the others. Its success and duration are recorded, and families that
several collectors emit (`gpufleet_gpu_info` from NVIDIA and AMD alike) are merged into one,
because the text format allows a family's HELP and TYPE only once.
"""

from __future__ import annotations

import contextvars
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
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
from exporter.collectors.selfstats import FAKE_NVML, REAL_NVML, CollectorOutcome, self_metrics
from exporter.collectors.server_memory import ServerMemoryCollector
from exporter.collectors.units import UnitsCollector
from exporter.collectors.vllm import VllmCollector
from exporter.sources.deadline import Batch, SerialReads
from exporter.sources.nvml import load_backend
from exporter.sources.pci import number_host_gpus
from exporter.sources.systemd import UnitsReader
from fleet.gpu_index import GpuIndex
from fleet.roster import Host

log = logging.getLogger(__name__)

DEFAULT_SCRAPE_TIMEOUT_SECONDS = 10.0
"""The scrape timeout assumed when the scraper names none (Prometheus' default, and ours)."""
TIMEOUT_OFFSET_SECONDS = 0.5
"""How far before the scraper's timeout the exporter answers (as blackbox_exporter does), at
most: a tenth of a short timeout (the lab scrapes with 1 s: the answer's transfer needs less
than half of it)."""
MIN_DEADLINE_SECONDS = 0.2
"""The shortest deadline a scrape gets, whatever the scraper says."""


def scrape_budget(timeout: float) -> float:
    """The seconds a scrape with the scraper's `timeout` has for its collectors."""
    return max(MIN_DEADLINE_SECONDS, timeout - min(TIMEOUT_OFFSET_SECONDS, timeout / 10))


SCRAPE_TIMEOUT: contextvars.ContextVar[float | None] = contextvars.ContextVar(
    "scrape_timeout", default=None
)
"""This scrape's timeout in seconds, set by the HTTP handler from Prometheus' header."""


def _job_key(index: int, collector: SourceCollector) -> str:
    return f"{index}/{collector.name}"  # by position: two collectors may share a name


# One collector's part of a scrape: its families, its outcome, its error ("" when none).
_Result = tuple[list[Metric], CollectorOutcome, str]

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
        default_timeout_seconds: float = DEFAULT_SCRAPE_TIMEOUT_SECONDS,
        patience_seconds: float = 5.0,
        nvml: str = REAL_NVML,
    ) -> None:
        self.collectors = list(collectors)
        self._clock = clock
        self._default_timeout = default_timeout_seconds
        self._patience = patience_seconds
        self._nvml = nvml  # which NVML backend: a fake one must say so in every scrape
        # Collectors run off the scrape thread, at most once at a time: they keep per-scrape
        # state (CPU deltas, NVML's worker), and two scrapers at once (an HA pair of
        # Prometheus) must not double the load on a struggling GPU. The local ones run in turn
        # on one worker (one hand-off per scrape), each collector that waits on the network on
        # a worker of its own, beside them (a slow server costs its own timeout once, not on
        # top of NVML's deadline). A scrape that finds a group's batch started by a scrape
        # still within its deadline shares that batch's results; a collector left behind at
        # a deadline is stuck, and refused until it returns. No lock is held across a scrape.
        self._groups: list[tuple[SerialReads, list[int]]] = []
        local = [i for i, c in enumerate(self.collectors) if not getattr(c, "reads_network", False)]
        if local:
            self._groups.append((SerialReads("collect"), local))
        for i, c in enumerate(self.collectors):
            if getattr(c, "reads_network", False):
                self._groups.append((SerialReads(f"collect-{c.name}"), [i]))
        self._inflight_lock = threading.Lock()
        self._inflight: dict[int, tuple[Batch, float]] = {}  # by group: batch, its deadline
        self._interrupted = threading.Event()
        self._last_error: dict[str, str] = {}
        # Every collector's dropped count from the start, so that the first drop is an increase.
        self._dropped: dict[tuple[str, str, str], int] = {
            (c.name, "", UNRENDERABLE): 0 for c in self.collectors
        }
        self._dropped_lock = threading.Lock()

    def collect(self) -> Iterator[Metric]:
        """One scrape: every collector's families, merged by name, then the self metrics.

        Bounded by the scrape's timeout (`SCRAPE_TIMEOUT`, set from Prometheus' header, else
        the default) less an offset (`scrape_budget`): a collector not finished by then, or
        still running since an earlier scrape, reads `collector_success 0` and yields nothing
        this scrape; the others' families are answered on time.
        """
        timeout = SCRAPE_TIMEOUT.get() or self._default_timeout
        budget = scrape_budget(timeout)
        results = self._collect_all(time.monotonic() + budget, budget)
        merged: dict[str, Metric] = {}
        copied: set[str] = set()  # families shared with another scrape are never mutated
        outcomes = []
        for families, outcome, error in results:
            self._log_change(outcome.name, error)
            for family in families:
                _merge(merged, copied, family)
            outcomes.append(outcome)
        yield from merged.values()
        with self._dropped_lock:
            dropped = dict(self._dropped)
        for c in self.collectors:
            # A collector's own budgets (llama: slots, router models), by (server, reason).
            budgets: Callable[[], dict[tuple[str, str], int]] | None = getattr(c, "dropped", None)
            if budgets is not None:
                for (server, reason), count in budgets().items():
                    key = (c.name, server, reason)
                    dropped[key] = dropped.get(key, 0) + count
        yield from self_metrics(outcomes, dropped, self._nvml)

    def _start(self, group: int, deadline: float, budget: float) -> Batch:
        """This scrape's batch for `group`: a new one, or one a concurrent scrape started."""
        reads, members = self._groups[group]
        # A local collector stuck past half the budget is left behind and the next one runs,
        # still on time; a group of one (a collector of model servers) has only the deadline.
        patience = min(self._patience, budget / 2) if len(members) > 1 else math.inf
        with self._inflight_lock:
            running = self._inflight.get(group)
            if running is not None and not running[0].done and time.monotonic() < running[1]:
                return running[0]
            batch = reads.submit(
                [(_job_key(i, self.collectors[i]), partial(self._run, self.collectors[i]))
                 for i in members],
                patience=patience,
            )  # fmt: skip
            self._inflight[group] = (batch, deadline)
            return batch

    def _collect_all(self, deadline: float, budget: float) -> list[_Result]:
        started = time.monotonic()
        batches = [self._start(g, deadline, budget) for g in range(len(self._groups))]
        for batch in batches:
            # In slices, so that shutdown (`interrupt`) is never kept waiting for a deadline.
            while not self._interrupted.is_set() and time.monotonic() < deadline:
                if batch.wait(min(deadline, time.monotonic() + 0.25)):
                    break
        got = {}
        for batch in batches:
            finished = batch.finish()
            got.update({key: ("ok", value) for key, value in finished.results.items()})
            got.update({key: ("refused", None) for key in finished.refused})
        results: list[_Result] = []
        for i, c in enumerate(self.collectors):
            kind, value = got.get(_job_key(i, c), ("late", None))
            if kind == "ok":
                results.append(value)  # _run never raises
            elif kind == "refused":
                error = "stuck since an earlier scrape; not started again until it returns"
                results.append(([], CollectorOutcome(c.name, False, 0.0), error))
            else:
                error = f"did not finish in time (left behind; the scrape's budget: {budget:.3g} s)"
                waited = time.monotonic() - started
                results.append(([], CollectorOutcome(c.name, False, waited), error))
        return results

    def _run(self, collector: SourceCollector) -> _Result:
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
                key = (collector.name, "", UNRENDERABLE)
                self._dropped[key] = self._dropped.get(key, 0) + sum(bad.values())
        duration = self._clock() - start
        return families, CollectorOutcome(collector.name, success, duration), error

    def interrupt(self) -> None:
        """Make scrapes in progress answer now with what they have (at shutdown)."""
        self._interrupted.set()

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
        self._interrupted.set()
        for reads, _ in self._groups:
            reads.close()


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


def _merge(merged: dict[str, Metric], copied: set[str], family: Metric) -> None:
    existing = merged.get(family.name)
    if existing is None:
        merged[family.name] = family
        return
    if existing.type != family.type:
        # A bug between two collectors; keep the first and say so rather than break the text.
        log.error("family %s emitted as %s and as %s", family.name, existing.type, family.type)
        return
    if family.name not in copied:
        # A collector's families may be shared by two scrapes at once: merge into a copy.
        existing = Metric(existing.name, existing.documentation, existing.type, existing.unit)
        existing.samples = list(merged[family.name].samples)
        merged[family.name] = existing
        copied.add(family.name)
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
        HwmonCollector(
            settings.sysfs,
            thermal=thermal,
            procfs=settings.procfs,
            timeout_seconds=settings.collector_timeout_seconds,
        ),
        HostCollector(procfs=settings.procfs),
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
    nvml = FAKE_NVML if settings.nvml_fake_scenario is not None else REAL_NVML
    fleet = FleetCollector(build_collectors(settings), nvml=nvml)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(fleet)
    return registry, fleet
