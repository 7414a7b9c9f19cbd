"""NVIDIA GPUs through NVML (`nvidia-ml-py`), read on one worker thread under a deadline.

Sample output (`gpu-fleet-exporter --nvml.fake-scenario examples/nvml-fake/two-h200.yaml --once`)::

    gpufleet_gpu_info{card="",gpu="0",model="NVIDIA H200",pci_bus_id="0000:18:00.0",...} 1.0
    gpufleet_gpu_up{gpu="0"} 1.0
    gpufleet_gpu_power_watts{gpu="0"} 612.48
    gpufleet_gpu_throttle_active{gpu="1",reason="sw_power_cap"} 1.0
    gpufleet_gpu_compute_mode{gpu="0",mode="exclusive_process"} 1.0

Check a real host by hand with `nvidia-smi -q` or, for the common fields,
`nvidia-smi --query-gpu=pci.bus_id,uuid,utilization.gpu,memory.used,memory.reserved,\
temperature.gpu,power.draw,power.limit,clocks.sm,clocks_event_reasons.active,compute_mode
--format=csv`.

How it copes with a GPU falling off the bus:

- Every NVML call runs on one dedicated worker thread, because a call to a dying GPU can block
  for tens of seconds inside the driver. `collect()` waits for the worker at most
  `timeout_seconds`; devices already read are exported, and `CollectorError` marks the scrape.
  While the worker is still stuck, no more work is queued behind it: scrapes answer at once
  until the call returns.
- "Not read this scrape" is kept apart from "read and failed". `gpufleet_gpu_up` is the answer
  of a read: 1 readable, 0 lost or erroring. A GPU whose read did not finish has no `gpu_up`
  at all (unknown is absent); instead `gpufleet_gpu_read_timeout{gpu}` is 1 for the one GPU
  the worker is stuck in (its call did not return within the deadline, in this scrape or one
  before), 0 for every GPU read this scrape, and absent for a GPU not reached because the
  worker was stuck on another. A 0/1 per GPU rather than a last-read timestamp: a timestamp
  ages alike for the stuck GPU and for the healthy ones queued behind it on the one NVML
  thread, so "not read for 2 minutes" would again name every card; the 0/1 names the card the
  call hangs in, which is the per-card evidence `GpuLost` (cause `hung`) needs, and its `for:`
  gives the 2 minutes. A GPU that timed out is read last in the next scrapes, so one hung card
  does not keep the others from being read.
- A call raising NOT_SUPPORTED (or another error that is not about the device as a whole) drops
  that field only. GPU_IS_LOST turns the device to `gpufleet_gpu_up 0`; it keeps its `gpu`
  index and `gpufleet_gpu_info`, and the other GPUs are unaffected.
- NVML is re-initialised after such failures (at most once per `reinit_interval_seconds`).
  NVML may number its devices differently afterwards, so devices are keyed by PCI bus id and
  `gpu` indices come from the shared `GpuIndex`, never from NVML.
- Xid errors arrive as NVML events. The same worker waits for them briefly between scrapes and
  before each scrape, so NVML is only ever used from that one thread.
- A device is read by a `_DeviceReader`, given what the collector knew of it (`_Known`) and
  returning what it read and learned (`_Outcome`: samples, static values, whether the GPU is
  lost, failures to log); the collector alone keeps that, in `_learn`, after each read.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TypeVar

import pynvml
from prometheus_client.metrics_core import Metric

from exporter.collectors import catalogue
from exporter.collectors.base import CollectorError
from exporter.collectors.server_memory import GpuProcesses
from exporter.sources.nvml import (
    CLOCKS_EVENT_REASONS,
    COMPUTE_MODES,
    NvmlBackend,
    error_code,
    field_value,
    handle_key,
    is_gpu_lost,
    is_library_missing,
    is_not_supported,
    is_timeout,
    needs_reinit,
    pci_id,
)
from exporter.sources.text import clean_label
from fleet.gpu_index import GpuIndex, normalize_pci_bus_id

log = logging.getLogger(__name__)

T = TypeVar("T")


def _label(value: object) -> str:
    """An identity string from NVML as a label value ("" where it gave none)."""
    return clean_label(value) if isinstance(value, str) else ""


VENDOR = "nvidia"

# Event waits are short so that a scrape never queues long behind one; between scrapes the
# worker polls every second, so the driver's event queue is drained even without scrapes.
_XID_WAIT_MS = 10
_IDLE_POLL_SECONDS = 1.0
_MAX_EVENTS_PER_DRAIN = 256

_CLOCKS = (
    ("sm", pynvml.NVML_CLOCK_SM),
    ("memory", pynvml.NVML_CLOCK_MEM),
    ("graphics", pynvml.NVML_CLOCK_GRAPHICS),
)
_ECC_KINDS = (
    ("corrected", pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED),
    ("uncorrected", pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED),
)
_RETIREMENT_CAUSES = (
    ("single_bit_ecc", pynvml.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS),
    ("double_bit_ecc", pynvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR),
)


# Per-device families, in exposition order; names, help and labels are the catalogue's
# (exporter/collectors/catalogue.py), whose first label is `gpu`.
_DEVICE_FAMILIES: tuple[str, ...] = (
    "gpufleet_gpu_utilization_ratio",
    "gpufleet_gpu_memory_utilization_ratio",
    "gpufleet_gpu_memory_used_bytes",
    "gpufleet_gpu_memory_total_bytes",
    "gpufleet_gpu_temperature_celsius",
    "gpufleet_gpu_temperature_critical_celsius",
    "gpufleet_gpu_temperature_slowdown_celsius",
    "gpufleet_gpu_power_watts",
    "gpufleet_gpu_power_limit_watts",
    "gpufleet_gpu_energy_joules_total",
    "gpufleet_gpu_fan_speed_ratio",
    "gpufleet_gpu_clock_hertz",
    "gpufleet_gpu_clock_max_hertz",
    "gpufleet_gpu_throttle_active",
    "gpufleet_gpu_pcie_link_generation",
    "gpufleet_gpu_pcie_link_width",
    "gpufleet_gpu_pcie_replay_errors_total",
    "gpufleet_gpu_ecc_errors_total",
    "gpufleet_gpu_retired_pages",
    "gpufleet_gpu_retired_pages_pending",
    "gpufleet_gpu_remapped_rows",
    "gpufleet_gpu_remapped_rows_pending",
    "gpufleet_gpu_remapped_rows_failed",
    "gpufleet_gpu_compute_mode",
)


class _DeviceDown(Exception):
    """The device cannot be read this scrape: it is lost, or NVML's own state is broken."""


@dataclass
class _Device:
    """What the worker knows of one NVIDIA GPU, keyed by PCI bus id for the exporter's life."""

    bus_id: str
    pci_id: str
    handle: object | None = None  # None: not enumerated by the last nvmlInit
    lost: bool = False  # GPU_IS_LOST since the last nvmlInit: not called again until re-init
    uuid: str = ""
    model: str = ""
    vbios: str = ""
    identity_read: bool = False
    static: dict[str, int] = field(default_factory=dict)  # values that never change
    memory_v2: bool | None = None  # whether nvmlDeviceGetMemoryInfo_v2 works (old drivers)


@dataclass(frozen=True)
class _Identity:
    bus_id: str
    pci_id: str
    uuid: str
    model: str
    vbios: str


@dataclass
class _Reading:
    """One device's samples of one scrape, labels after `gpu`."""

    up: bool
    samples: dict[str, list[tuple[tuple[str, ...], float]]] = field(default_factory=dict)
    processes: GpuProcesses | None = None  # None: the device was not read whole


class _Job:
    """A unit of work for the worker; `collect()` reads its per-device results as they land."""

    def __init__(self, run: Callable[[_Job], None]) -> None:
        self.run = run
        self.done = threading.Event()
        self.cancelled = threading.Event()
        self.failure: str | None = None
        self.current: str | None = None  # the bus id of the device the worker is reading
        self._lock = threading.Lock()
        self._readings: dict[str, _Reading] = {}

    def record(self, bus_id: str, reading: _Reading) -> None:
        with self._lock:
            self._readings[bus_id] = reading

    def readings(self) -> dict[str, _Reading]:
        with self._lock:
            return dict(self._readings)


class _CallTracker:
    """The NVML call in progress, for a timeout's message; every NVML call goes through it.

    Written by the worker thread only; read by `collect()` to name what a deadline hit.
    """

    def __init__(self) -> None:
        # (call, bus id, since): what the worker is inside of.
        self._in_call: tuple[str, str | None, float] | None = None

    def call(self, bus_id: str | None, fn: Callable[..., T], *args: object) -> T:
        """`fn(*args)`, recorded as in progress until it returns or raises."""
        self._in_call = (getattr(fn, "__name__", "nvml"), bus_id, time.monotonic())
        try:
            return fn(*args)
        finally:
            self._in_call = None

    def describe(self) -> str:
        """The call in progress and for how long, or "(between calls)"."""
        in_call = self._in_call
        if in_call is None:
            return "(between calls)"
        name, bus_id, since = in_call
        where = f" on GPU {bus_id}" if bus_id else ""
        return f"{name}{where} (for {time.monotonic() - since:.1f} s)"


@dataclass(frozen=True)
class _Known:
    """What the collector knew of a device before a read: the reader's input, never written."""

    bus_id: str
    handle: object
    static: Mapping[str, int]
    memory_v2: bool | None
    identity_read: bool


@dataclass
class _Outcome:
    """What one read of a device found: its reading, and what the collector should remember."""

    reading: _Reading
    learned: dict[str, int] = field(default_factory=dict)  # static values read for the first time
    memory_v2: bool | None = None  # whether nvmlDeviceGetMemoryInfo_v2 answered; None: not tried
    identity: tuple[str, str, str] | None = None  # model, uuid, vbios ("" where unknown)
    lost: bool = False  # GPU_IS_LOST: not to be called again until re-init
    needs_reinit: bool = False
    # (call, error, consequence) of each failure, for the collector's log (once per kind).
    failures: list[tuple[str, BaseException, str]] = field(default_factory=list)


class _DeviceReader:
    """One device's NVML calls within one scrape, each answer sorted by what it means.

    Reads from what the collector knew (`_Known`) and returns an `_Outcome`; it holds no
    reference to the collector, so whatever a read learns reaches the collector's state only
    through `NvidiaCollector._learn`, on the worker thread, after the read.
    """

    def __init__(self, nvml: NvmlBackend, calls: _CallTracker, known: _Known) -> None:
        self._nvml = nvml
        self._calls = calls
        self._known = known
        self.answers = 0
        self.errors = 0
        self.samples: dict[str, list[tuple[tuple[str, ...], float]]] = {}
        self.processes = GpuProcesses()
        self.learned: dict[str, int] = {}
        self.memory_v2: bool | None = None
        self.identity: tuple[str, str, str] | None = None
        self.lost = False
        self.needs_reinit = False
        self.failures: list[tuple[str, BaseException, str]] = []

    def read(self) -> _Outcome:
        """The identity (while unknown) and every field of the device."""
        try:
            if not self._known.identity_read:
                self._identity()
            self._fields()
        except _DeviceDown:
            return self._outcome(_Reading(up=False))
        # Every call failing (and not as "not supported") is a GPU that answers nothing.
        if not (self.answers > 0 or self.errors == 0):
            return self._outcome(_Reading(up=False))
        return self._outcome(_Reading(up=True, samples=self.samples, processes=self.processes))

    def read_identity(self) -> _Outcome:
        """The identity alone (at enumeration); the reading says whether the device answered."""
        try:
            self._identity()
        except _DeviceDown:
            return self._outcome(_Reading(up=False))
        return self._outcome(_Reading(up=True))

    def _outcome(self, reading: _Reading) -> _Outcome:
        return _Outcome(
            reading=reading,
            learned=self.learned,
            memory_v2=self.memory_v2,
            identity=self.identity,
            lost=self.lost,
            needs_reinit=self.needs_reinit,
            failures=self.failures,
        )

    def add(self, family: str, labels: tuple[str, ...], value: float) -> None:
        self.samples.setdefault(family, []).append((labels, float(value)))

    def get(self, fn: Callable[..., T], *args: object) -> T | None:
        """The call's answer, or None when it failed for this field alone."""
        try:
            value = self._calls.call(self._known.bus_id, fn, *args)
        except pynvml.NVMLError as err:
            self.failed(getattr(fn, "__name__", "nvml"), err)
            return None
        self.answers += 1
        return value

    def field(self, field_id: int) -> float | None:
        """One `NVML_FI_*` value; each field of nvmlDeviceGetFieldValues fails on its own."""
        values = self.get(self._nvml.nvmlDeviceGetFieldValues, self._known.handle, [field_id])
        if not values:
            return None
        try:
            return field_value(values[0])
        except pynvml.NVMLError as err:
            self.failed(f"nvmlDeviceGetFieldValues({field_id})", err)
            return None

    def _cached(self, key: str) -> int | None:
        known = self._known.static.get(key)
        return known if known is not None else self.learned.get(key)

    def static(self, key: str, fn: Callable[..., int], *args: object) -> int | None:
        """A value that never changes for the device: read until it is known, then cached."""
        cached = self._cached(key)
        if cached is not None:
            return cached
        value = self.get(fn, *args)
        if value is not None:
            self.learned[key] = value
        return value

    def failed(self, call: str, err: BaseException) -> None:
        """Sort a failure: raise `_DeviceDown` for the device as a whole, else drop the field."""
        if is_gpu_lost(err):
            self.lost = self.needs_reinit = True
            self.failures.append((call, err, "the GPU reads as down until re-init"))
            raise _DeviceDown(self._known.bus_id) from err
        if needs_reinit(err):
            self.needs_reinit = True
            self.failures.append((call, err, "NVML needs re-initialisation"))
            raise _DeviceDown(self._known.bus_id) from err
        if not is_not_supported(err):
            # No permission, an unknown error...: the field is unknown, so it is left out; a
            # device whose every call fails like this reads as down (see `read`).
            self.errors += 1
            self.failures.append((call, err, "field left out"))

    def _identity(self) -> None:
        nvml, handle = self._nvml, self._known.handle
        model = self.get(nvml.nvmlDeviceGetName, handle)
        uuid = self.get(nvml.nvmlDeviceGetUUID, handle)
        vbios = self.get(nvml.nvmlDeviceGetVbiosVersion, handle)
        # The driver's strings, yet a label value must never fail the exposition.
        self.identity = (_label(model), _label(uuid), _label(vbios))

    def _fields(self) -> None:
        nvml, h = self._nvml, self._known.handle

        util = self.get(nvml.nvmlDeviceGetUtilizationRates, h)
        if util is not None:
            self.add("gpufleet_gpu_utilization_ratio", (), util.gpu / 100)
            self.add("gpufleet_gpu_memory_utilization_ratio", (), util.memory / 100)

        self._memory()

        temp = self.get(nvml.nvmlDeviceGetTemperature, h, pynvml.NVML_TEMPERATURE_GPU)
        if temp is not None:
            self.add("gpufleet_gpu_temperature_celsius", ("gpu",), temp)
        # HBM temperature has no call of its own, only a field id (nvml.h NVML_FI_DEV_MEMORY_TEMP).
        mem_temp = self.field(pynvml.NVML_FI_DEV_MEMORY_TEMP)
        if mem_temp is not None:
            self.add("gpufleet_gpu_temperature_celsius", ("memory",), mem_temp)
        for family, sensor, threshold in (
            ("gpufleet_gpu_temperature_critical_celsius", "gpu",
             pynvml.NVML_TEMPERATURE_THRESHOLD_SHUTDOWN),
            ("gpufleet_gpu_temperature_critical_celsius", "memory",
             pynvml.NVML_TEMPERATURE_THRESHOLD_MEM_MAX),
            ("gpufleet_gpu_temperature_slowdown_celsius", "gpu",
             pynvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN),
        ):  # fmt: skip
            limit = self.static(
                f"threshold:{threshold}", nvml.nvmlDeviceGetTemperatureThreshold, h, threshold
            )
            if limit is not None:
                self.add(family, (sensor,), limit)

        self._power()

        fan = self.get(nvml.nvmlDeviceGetFanSpeed, h)
        if fan is not None:
            # nvml.h: the intended speed, which "may exceed 100% in some cases"; kept as is.
            self.add("gpufleet_gpu_fan_speed_ratio", (), fan / 100)

        for clock, clock_type in _CLOCKS:
            current = self.get(nvml.nvmlDeviceGetClockInfo, h, clock_type)
            if current is not None:
                self.add("gpufleet_gpu_clock_hertz", (clock,), current * 1e6)
            top = self.static(
                f"max_clock:{clock_type}", nvml.nvmlDeviceGetMaxClockInfo, h, clock_type
            )
            if top is not None:
                self.add("gpufleet_gpu_clock_max_hertz", (clock,), top * 1e6)

        reasons = self.get(nvml.nvmlDeviceGetCurrentClocksEventReasons, h)
        if reasons is not None:
            for reason, bit in CLOCKS_EVENT_REASONS.items():
                self.add("gpufleet_gpu_throttle_active", (reason,), 1 if reasons & bit else 0)

        generation = self.get(nvml.nvmlDeviceGetCurrPcieLinkGeneration, h)
        if generation is not None:
            self.add("gpufleet_gpu_pcie_link_generation", (), generation)
        width = self.get(nvml.nvmlDeviceGetCurrPcieLinkWidth, h)
        if width is not None:
            self.add("gpufleet_gpu_pcie_link_width", (), width)
        replays = self.get(nvml.nvmlDeviceGetPcieReplayCounter, h)
        if replays is not None:
            self.add("gpufleet_gpu_pcie_replay_errors_total", (), replays)

        self._memory_health()

        self._processes()

        mode = self.get(nvml.nvmlDeviceGetComputeMode, h)
        if mode is not None:
            for name, value in COMPUTE_MODES.items():
                self.add("gpufleet_gpu_compute_mode", (name,), 1 if mode == value else 0)

    def _processes(self) -> None:
        """Which pids hold how much memory on the GPU, for `gpufleet_server_gpu_memory_bytes`.

        On an MPS host (EXCLUSIVE_PROCESS + nvidia-cuda-mps-control) the compute list holds the
        MPS server and the clients appear only in the MPS list, so both are read. A list NVML
        cannot give (NO_PERMISSION, NOT_SUPPORTED, ...) makes the GPU's process list
        incomplete, and a process listed without `usedGpuMemory` (pynvml's None for
        NVML_VALUE_NOT_AVAILABLE: MIG, vGPU, WDDM) has an unknown amount: either way the
        memory collector must not read the gaps as 0. One exception: the MPS list answering
        NOT_SUPPORTED, which NVML does on every GPU older than Volta ("For Volta or newer
        fully supported devices", nvml.h), where MPS clients are never listed and only the
        MPS server shows, in the compute list.
        """
        nvml, h = self._nvml, self._known.handle
        for fn, optional in (
            (nvml.nvmlDeviceGetComputeRunningProcesses, False),
            (nvml.nvmlDeviceGetMPSComputeRunningProcesses, True),
        ):
            call = getattr(fn, "__name__", "nvml")
            try:
                listed = self._calls.call(self._known.bus_id, fn, h)
            except pynvml.NVMLError as err:
                self.failed(call, err)  # raises for the device as a whole
                if not (optional and is_not_supported(err)):
                    self.processes.incomplete = f"{call}: {err}"
                continue
            self.answers += 1
            for proc in listed or ():
                used = getattr(proc, "usedGpuMemory", None)
                pid = getattr(proc, "pid", None)
                if not isinstance(pid, int):
                    continue
                if isinstance(used, int):
                    self.processes.used[pid] = max(used, self.processes.used.get(pid, 0))
                else:
                    self.processes.unknown.add(pid)

    def _memory(self) -> None:
        nvml, h = self._nvml, self._known.handle
        if self._known.memory_v2 is not False:
            # v2 (driver 510+) splits the driver's reservation out of `used`.
            mem = self.get(nvml.nvmlDeviceGetMemoryInfo, h, pynvml.nvmlMemory_v2)
            if mem is not None:
                self.memory_v2 = True
                self.add("gpufleet_gpu_memory_used_bytes", ("vram",), mem.used)
                reserved: object = getattr(mem, "reserved", None)
                if isinstance(reserved, int):
                    self.add("gpufleet_gpu_memory_used_bytes", ("reserved",), reserved)
                self.add("gpufleet_gpu_memory_total_bytes", ("vram",), mem.total)
                return
        mem = self.get(nvml.nvmlDeviceGetMemoryInfo, h)
        if mem is not None:
            self.memory_v2 = False
            # v1's `used` is "the sum of reserved and allocated" (nvml.h nvmlMemory_t): no split.
            self.add("gpufleet_gpu_memory_used_bytes", ("vram",), mem.used)
            self.add("gpufleet_gpu_memory_total_bytes", ("vram",), mem.total)

    def _power(self) -> None:
        nvml, h = self._nvml, self._known.handle
        # NVML reports power in milliwatts and energy in millijoules.
        power = self.get(nvml.nvmlDeviceGetPowerUsage, h)
        if power is not None:
            self.add("gpufleet_gpu_power_watts", (), power / 1000)
        limits: list[tuple[str, int | None]] = [
            ("current", self.get(nvml.nvmlDeviceGetEnforcedPowerLimit, h)),
            ("default", self.static("default", nvml.nvmlDeviceGetPowerManagementDefaultLimit, h)),
        ]
        if self._cached("power_min") is None:
            constraints = self.get(nvml.nvmlDeviceGetPowerManagementLimitConstraints, h)
            if constraints is not None and len(constraints) == 2:
                self.learned["power_min"], self.learned["power_max"] = constraints
        limits += [("min", self._cached("power_min")), ("max", self._cached("power_max"))]
        for kind, milliwatts in limits:
            if milliwatts is not None:
                self.add("gpufleet_gpu_power_limit_watts", (kind,), milliwatts / 1000)
        energy = self.get(nvml.nvmlDeviceGetTotalEnergyConsumption, h)
        if energy is not None:
            self.add("gpufleet_gpu_energy_joules_total", (), energy / 1000)

    def _memory_health(self) -> None:
        nvml, h = self._nvml, self._known.handle
        for kind, error_type in _ECC_KINDS:
            # Aggregate: the lifetime count, which survives driver reloads (volatile does not).
            aggregate = pynvml.NVML_AGGREGATE_ECC
            count = self.get(nvml.nvmlDeviceGetTotalEccErrors, h, error_type, aggregate)
            if count is not None:
                self.add("gpufleet_gpu_ecc_errors_total", (kind,), count)
        # Page retirement is pre-Ampere; Ampere and newer remap rows instead and answer
        # NOT_SUPPORTED here (and the other way round on older boards).
        for cause, source in _RETIREMENT_CAUSES:
            pages = self.get(nvml.nvmlDeviceGetRetiredPages, h, source)
            if pages is not None:
                self.add("gpufleet_gpu_retired_pages", (cause,), len(pages))
        pending = self.get(nvml.nvmlDeviceGetRetiredPagesPendingStatus, h)
        if pending is not None:
            self.add("gpufleet_gpu_retired_pages_pending", (), 1 if pending else 0)
        rows = self.get(nvml.nvmlDeviceGetRemappedRows, h)
        if rows is not None:
            correctable, uncorrectable, rows_pending, rows_failed = rows
            self.add("gpufleet_gpu_remapped_rows", ("correctable",), correctable)
            self.add("gpufleet_gpu_remapped_rows", ("uncorrectable",), uncorrectable)
            self.add("gpufleet_gpu_remapped_rows_pending", (), 1 if rows_pending else 0)
            self.add("gpufleet_gpu_remapped_rows_failed", (), 1 if rows_failed else 0)


class NvidiaCollector:
    """NVIDIA GPUs via an NVML backend (`pynvml`, or `FakeNvml` in tests and demos)."""

    name = "nvidia"

    def __init__(
        self,
        backend: NvmlBackend,
        *,
        gpu_index: GpuIndex,
        expected_count: int | None,
        expected_compute_mode: str | None = None,
        timeout_seconds: float = 4.0,
        reinit_interval_seconds: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if expected_count is not None and expected_count < 0:
            raise ValueError(f"expected_count must be >= 0, not {expected_count}")
        if expected_compute_mode is not None and expected_compute_mode not in COMPUTE_MODES:
            raise ValueError(
                f"expected_compute_mode must be one of {', '.join(COMPUTE_MODES)}, "
                f"not {expected_compute_mode!r}"
            )
        self._nvml = backend
        self._gpu_index = gpu_index
        self._expected = expected_count
        self._expected_mode = expected_compute_mode
        self._timeout = timeout_seconds
        self._reinit_interval = reinit_interval_seconds
        self._clock = clock
        # Guards what collect() reads while the worker writes: devices, Xid counts, busy job.
        self._lock = threading.Lock()
        self._processes: dict[str, GpuProcesses] = {}  # from the last scrape, by bus id
        # GPUs whose read timed out lately: read last, so that they cannot starve the others.
        self._slow: set[str] = set()
        self._devices: dict[str, _Device] = {}
        self._xids: dict[str, dict[int, int]] = {}
        self._busy: _Job | None = None
        self._closed = False
        # The worker's own state (touched only on the worker thread).
        self._initialized = False
        self._init_error: BaseException | None = None
        self._needs_reinit = False
        self._last_init_attempt: float | None = None
        self._event_set: object | None = None
        self._bus_by_handle: dict[int, str] = {}
        self._logged: set[tuple[str, str, int | None]] = set()
        self._calls = _CallTracker()  # every NVML call, so a timeout can name the one it is in
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        self._worker = threading.Thread(target=self._work, name="nvml-worker", daemon=True)
        self._worker.start()
        # Initialise and enumerate now, so pci_bus_ids() can answer before `gpu` indices are
        # assigned; under the deadline, since nvmlInit itself can hang on a sick GPU.
        job = self._submit(self._start)
        if job is not None and not job.done.wait(timeout_seconds):
            log.warning(
                "NVML initialisation did not finish within %g s (%s); `gpu` indices come from "
                "PCI sysfs, only an NVIDIA GPU it lacks would be numbered after the others",
                timeout_seconds,
                self._calls.describe(),
            )

    # -- the collector contract ----------------------------------------------------------------

    def pci_bus_ids(self) -> list[str]:
        """PCI bus ids (sysfs form) of the NVIDIA GPUs found so far."""
        with self._lock:
            return sorted(self._devices)

    def collect(self) -> Iterator[Metric]:
        """One scrape; yields what it could read, then raises `CollectorError` on a failure."""
        job = self._submit(self._scrape)
        if job is None:
            if self._closed:
                return
            # Still inside a call from an earlier scrape: queueing behind it would only stack
            # up stuck scrapes. Answer at once: the GPU the call is stuck in timed out, the
            # others were not read (unknown, so absent).
            with self._lock:
                stuck = self._busy.current if self._busy is not None else None
            message = (
                f"NVML worker still stuck in {self._calls.describe()}; no new NVML work queued"
            )
            self._processes = {}
            yield from self._families({}, {stuck} if stuck else set())
            raise CollectorError(message)
        finished = job.done.wait(self._timeout)
        timed_out: set[str] = set()
        if not finished:
            job.cancelled.set()  # the worker stops this job when the stuck call returns
            message = (
                f"NVML call {self._calls.describe()} did not return within {self._timeout:g} s"
            )
            current = job.current
            if current is not None:
                timed_out.add(current)
        readings = job.readings()
        timed_out -= set(readings)  # it returned between the deadline and now: it was read
        with self._lock:
            self._slow = (self._slow - set(readings)) | timed_out
        self._processes = {
            bus: r.processes for bus, r in readings.items() if r.up and r.processes is not None
        }
        yield from self._families(readings, timed_out)
        if not finished:
            raise CollectorError(message)
        if job.failure is not None:
            raise CollectorError(job.failure)

    def process_memory(self) -> dict[str, GpuProcesses]:
        """GPU memory by pid, per GPU (PCI bus id) read whole by the last scrape."""
        return dict(self._processes)

    def close(self) -> None:
        """Stop the worker (which frees the event set and shuts NVML down)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._jobs.put(None)
        self._worker.join(self._timeout)
        if self._worker.is_alive():
            log.warning(
                "NVML worker did not stop within %g s (in %s); leaving it behind",
                self._timeout,
                self._calls.describe(),
            )

    # -- families ------------------------------------------------------------------------------

    def _families(self, readings: dict[str, _Reading], timed_out: set[str]) -> Iterator[Metric]:
        with self._lock:
            devices = sorted(
                (
                    self._gpu_index.index_of(d.bus_id),
                    _Identity(d.bus_id, d.pci_id, d.uuid, d.model, d.vbios),
                )
                for d in self._devices.values()
            )
            xids = {bus_id: dict(counts) for bus_id, counts in self._xids.items()}
        info = catalogue.gauge("gpufleet_gpu_info")
        up = catalogue.gauge("gpufleet_gpu_up")
        read_timeout = catalogue.gauge("gpufleet_gpu_read_timeout")
        per_device = {name: catalogue.scalar(name) for name in _DEVICE_FAMILIES}
        expected_mode = catalogue.gauge("gpufleet_gpu_compute_mode_expected")
        xid = catalogue.counter("gpufleet_gpu_xid_errors_total")
        gpus_up = unread = 0
        for index, ident in devices:
            gpu = str(index)
            info.add_metric(
                [gpu, ident.uuid, ident.bus_id, VENDOR, ident.model, ident.pci_id, "", ident.vbios],
                1,
            )
            reading = readings.get(ident.bus_id)
            if reading is None:
                # Not read this scrape: neither up nor down, and not lost either.
                unread += 1
                if ident.bus_id in timed_out:
                    read_timeout.add_metric([gpu], 1)
            elif reading.up:
                gpus_up += 1
                up.add_metric([gpu], 1)
                read_timeout.add_metric([gpu], 0)
                for name, samples in reading.samples.items():
                    for labels, value in samples:
                        per_device[name].add_metric([gpu, *labels], value)
            else:
                up.add_metric([gpu], 0)
                read_timeout.add_metric([gpu], 0)
            if self._expected_mode is not None:
                for mode in COMPUTE_MODES:
                    expected_mode.add_metric([gpu, mode], 1 if mode == self._expected_mode else 0)
            for code, count in sorted(xids.get(ident.bus_id, {}).items()):
                xid.add_metric([gpu, str(code)], count)
        families: list[Metric] = [info, up, read_timeout]
        if self._expected is not None:
            expected = catalogue.gauge("gpufleet_gpus_expected")
            expected.add_metric([VENDOR], self._expected)
            lost = catalogue.gauge("gpufleet_gpus_lost")
            lost.add_metric([VENDOR], max(0, self._expected - gpus_up - unread))
            families += [expected, lost]
        families += [*per_device.values(), expected_mode, xid]
        # Only families with samples: on a host without NVIDIA GPUs this collector is silent.
        yield from (f for f in families if f.samples)

    # -- the worker ----------------------------------------------------------------------------

    def _submit(self, run: Callable[[_Job], None]) -> _Job | None:
        """Queue a job, unless closed or the worker is still busy with an earlier one."""
        with self._lock:
            if self._closed or self._busy is not None:
                return None
            job = _Job(run)
            self._busy = job
        self._jobs.put(job)
        return job

    def _work(self) -> None:
        while True:
            try:
                job = self._jobs.get(timeout=_IDLE_POLL_SECONDS)
            except queue.Empty:
                self._guarded(self._drain_xids)
                continue
            if job is None:
                self._guarded(self._stop)
                return
            try:
                job.run(job)
            except Exception as err:
                # A bug here must not kill the thread every later scrape depends on.
                log.exception("NVML worker job failed")
                job.failure = f"NVML worker failed: {type(err).__name__}: {err}"
            finally:
                with self._lock:
                    self._busy = None
                job.done.set()

    def _guarded(self, step: Callable[[], None]) -> None:
        try:
            step()
        except Exception:
            log.exception("NVML worker step %s failed", getattr(step, "__name__", step))

    def _log_once(self, bus_id: str, call: str, err: BaseException, what: str) -> None:
        # A lost GPU fails the same way every scrape; one line per (GPU, call, error) is enough.
        key = (bus_id, call, error_code(err))
        if key not in self._logged:
            self._logged.add(key)
            log.warning("NVML %s on %s: %s (%s)", call, bus_id or "-", err, what)

    # -- NVML life cycle (worker thread) ---------------------------------------------------------

    def _start(self, job: _Job) -> None:
        self._reinit()

    def _stop(self) -> None:
        self._free_event_set()
        if self._initialized:
            self._initialized = False
            try:
                self._calls.call(None, self._nvml.nvmlShutdown)
            except pynvml.NVMLError as err:
                log.debug("nvmlShutdown failed on close: %s", err)

    def _reinit_due(self) -> bool:
        if self._initialized and not self._needs_reinit:
            return False
        last = self._last_init_attempt
        return last is None or self._clock() - last >= self._reinit_interval

    def _reinit(self) -> None:
        """(Re-)initialise NVML and re-enumerate: handles from before do not outlive it."""
        self._last_init_attempt = self._clock()
        self._needs_reinit = False
        if self._initialized:
            self._free_event_set()
            self._initialized = False
            try:
                self._calls.call(None, self._nvml.nvmlShutdown)
            except pynvml.NVMLError as err:
                # Best effort: NVML may already consider itself shut down.
                log.debug("nvmlShutdown before re-init failed: %s", err)
        try:
            self._calls.call(None, self._nvml.nvmlInit)
        except pynvml.NVMLError as err:
            self._init_error = err
            with self._lock:
                for device in self._devices.values():
                    device.handle = None
            with self._lock:
                known = bool(self._devices)
            if is_library_missing(err) and not known and not self._expected:
                # A host without NVIDIA (none expected, none ever seen): nothing to say.
                log.debug("NVML not available: %s", err)
            else:
                self._log_once("", "nvmlInit", err, "no NVIDIA GPU can be read")
            return
        self._initialized = True
        self._init_error = None
        self._enumerate()
        self._register_events()

    def _enumerate(self) -> None:
        found: dict[str, object] = {}
        try:
            count = self._calls.call(None, self._nvml.nvmlDeviceGetCount)
        except pynvml.NVMLError as err:
            self._needs_reinit = True
            self._log_once("", "nvmlDeviceGetCount", err, "no NVIDIA GPU can be read")
            count = 0
        for index in range(count):
            try:
                handle = self._calls.call(None, self._nvml.nvmlDeviceGetHandleByIndex, index)
                info = self._calls.call(None, self._nvml.nvmlDeviceGetPciInfo, handle)
                bus_id = normalize_pci_bus_id(info.busId)
            except (pynvml.NVMLError, ValueError) as err:
                # Without its PCI bus id a device cannot get a `gpu` index; it still counts
                # against `gpufleet_gpus_expected` through `gpufleet_gpus_lost`.
                self._log_once("", f"nvml device {index}", err, "device skipped")
                continue
            with self._lock:
                device = self._devices.get(bus_id)
                if device is None:
                    device = _Device(bus_id, pci_id(info.pciDeviceId))
                    self._devices[bus_id] = device
                device.handle = handle
                device.lost = False
            found[bus_id] = handle
        with self._lock:
            devices = list(self._devices.values())
            for device in devices:
                if device.bus_id not in found:
                    device.handle = None  # vanished: `gpu_up 0`, index and info kept
        self._bus_by_handle = {handle_key(h): bus_id for bus_id, h in found.items()}
        for device in devices:
            if device.handle is not None and not device.identity_read:
                self._learn(device, self._reader(device).read_identity())

    def _register_events(self) -> None:
        with self._lock:
            targets = [
                (d.bus_id, d.handle)
                for d in self._devices.values()
                if d.handle is not None and not d.lost
            ]
        if not targets:
            return
        try:
            event_set = self._calls.call(None, self._nvml.nvmlEventSetCreate)
        except pynvml.NVMLError as err:
            self._log_once("", "nvmlEventSetCreate", err, "Xid errors will not be counted")
            return
        registered = 0
        for bus_id, handle in targets:
            try:
                self._calls.call(
                    bus_id,
                    self._nvml.nvmlDeviceRegisterEvents,
                    handle,
                    pynvml.nvmlEventTypeXidCriticalError,
                    event_set,
                )
            except pynvml.NVMLError as err:
                # NOT_SUPPORTED on some boards and in some VMs (nvml.h: "Only supported on
                # Fermi and newer, Linux only"): no Xid series for that GPU, nothing else lost.
                if not is_not_supported(err):
                    self._log_once(bus_id, "nvmlDeviceRegisterEvents", err, "no Xid counting")
                continue
            registered += 1
        if registered:
            self._event_set = event_set
            return
        try:
            self._calls.call(None, self._nvml.nvmlEventSetFree, event_set)
        except pynvml.NVMLError as err:
            log.debug("nvmlEventSetFree failed: %s", err)

    def _free_event_set(self) -> None:
        event_set, self._event_set = self._event_set, None
        if event_set is None:
            return
        try:
            self._calls.call(None, self._nvml.nvmlEventSetFree, event_set)
        except pynvml.NVMLError as err:
            log.debug("nvmlEventSetFree failed: %s", err)

    def _drain_xids(self) -> None:
        """Count the Xid events waiting in the event set (each wait is short)."""
        event_set = self._event_set
        if event_set is None or not self._initialized:
            return
        for _ in range(_MAX_EVENTS_PER_DRAIN):
            try:
                data = self._calls.call(
                    None, self._nvml.nvmlEventSetWait_v2, event_set, _XID_WAIT_MS
                )
            except pynvml.NVMLError as err:
                if is_timeout(err):
                    return  # nothing waiting: the normal case
                if is_gpu_lost(err) or needs_reinit(err):
                    self._needs_reinit = True
                self._log_once("", "nvmlEventSetWait_v2", err, "Xid counting paused")
                return
            if not data.eventType & pynvml.nvmlEventTypeXidCriticalError:
                continue
            # An event's `device` is a new pointer object to the same device: match by address.
            bus_id = self._bus_by_handle.get(handle_key(data.device))
            if bus_id is None:
                log.warning("Xid %d on a device NVML did not enumerate", data.eventData)
                continue
            # nvml.h nvmlEventData_t: eventData is the Xid, 999 for an unknown Xid.
            code = int(data.eventData)
            with self._lock:
                counts = self._xids.setdefault(bus_id, {})
                counts[code] = counts.get(code, 0) + 1

    # -- a scrape (worker thread) ----------------------------------------------------------------

    def _scrape(self, job: _Job) -> None:
        if self._reinit_due():
            self._reinit()
        if not self._initialized:
            job.failure = self._init_failure()
            with self._lock:
                known = list(self._devices)
            for bus_id in known:  # NVML answered, with an error: read and failed
                job.record(bus_id, _Reading(up=False))
            return
        self._drain_xids()
        with self._lock:
            slow = set(self._slow)
            devices = sorted(self._devices.values(), key=lambda d: (d.bus_id in slow, d.bus_id))
        for device in devices:
            if job.cancelled.is_set():
                return  # the deadline passed during an earlier call: nobody reads the rest
            with self._lock:
                job.current = device.bus_id
            reading = self._read_device(device)
            job.record(device.bus_id, reading)
            with self._lock:
                job.current = None

    def _init_failure(self) -> str | None:
        err = self._init_error
        expected = self._expected or 0
        with self._lock:
            known = bool(self._devices)
        if err is not None and is_library_missing(err) and not known and expected == 0:
            return None  # no NVIDIA driver and none expected: a host without NVIDIA GPUs
        why = f"{type(err).__name__}: {err}" if err is not None else "not initialised"
        roster = f"; the roster expects {expected} NVIDIA GPUs" if expected else ""
        return f"NVML unavailable ({why}){roster}"

    def _read_device(self, device: _Device) -> _Reading:
        if device.handle is None or device.lost:
            return _Reading(up=False)
        outcome = self._reader(device).read()
        self._learn(device, outcome)
        return outcome.reading

    def _reader(self, device: _Device) -> _DeviceReader:
        known = _Known(
            bus_id=device.bus_id,
            handle=device.handle,
            static=dict(device.static),
            memory_v2=device.memory_v2,
            identity_read=device.identity_read,
        )
        return _DeviceReader(self._nvml, self._calls, known)

    def _learn(self, device: _Device, outcome: _Outcome) -> None:
        """Keep what a read learned: the one place a device read changes the collector."""
        for call, err, what in outcome.failures:
            self._log_once(device.bus_id, call, err, what)
        if outcome.needs_reinit:
            self._needs_reinit = True
        with self._lock:
            device.static.update(outcome.learned)
            if outcome.memory_v2 is not None:
                device.memory_v2 = outcome.memory_v2
            if outcome.identity is not None:
                device.model, device.uuid, device.vbios = outcome.identity
                device.identity_read = True
            if outcome.lost:
                device.lost = True
