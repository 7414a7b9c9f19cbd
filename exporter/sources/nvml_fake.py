"""FakeNvml: a STAND-IN FOR A GPU, NEVER FOR PRODUCTION.

!!! This module does not talk to any GPU. !!! It answers the pynvml calls of the NVIDIA
collector from a YAML *scenario* file, so that the collector can be tested, the e2e lab can run
and the exporter can be demonstrated on machines without an NVIDIA GPU:

    gpu-fleet-exporter --nvml.fake-scenario examples/nvml-fake/two-h200.yaml --once

Every number it reports comes from that file. Never point a production exporter at it: its
series look exactly like a real GPU's.

It behaves like pynvml, failures included, so that the collector's error handling is exercised:
each method has the parameter names and defaults of the installed pynvml function of the same
name (`tests/test_nvml_parity.py` checks it), returns pynvml's own ctypes structures (strings as
`str`, handles as `c_nvmlDevice_t` pointers), and fails with `pynvml.NVMLError(code)`, whose
subclass mapping is pynvml's own: calls before `nvmlInit` or after the last `nvmlShutdown` raise
UNINITIALIZED, a stale or foreign handle INVALID_ARGUMENT, an unsupported field NOT_SUPPORTED.

Scenario format (`tests/fixtures/nvml/*.yaml`, `examples/nvml-fake/*.yaml`)::

    library_missing: false            # true: nvmlInit raises LIBRARY_NOT_FOUND
    gpus:                             # NVML enumerates them in this order (NOT bus order)
      - pci_bus_id: "0000:41:00.0"    # any form; reported as NVML's `00000000:41:00.0`
        pci_device_id: 0x233510DE     # NVML's packing: device id << 16 | vendor id
        name: NVIDIA H200
        uuid: GPU-...
        vbios_version: 96.00.AF.00.01
        compute_mode: exclusive_process   # default | exclusive_thread | prohibited | ...
        utilization_percent: {gpu: 87, memory: 41}
        memory_bytes: {total: ..., used: ..., reserved: ...}   # v2 meaning of `used`
        temperature_celsius: 54
        memory_temperature_celsius: 61    # field NVML_FI_DEV_MEMORY_TEMP
        temperature_thresholds_celsius: {shutdown: 92, slowdown: 89, mem_max: 95}
        power_usage_milliwatts: 412000
        power_limit_milliwatts: {enforced: 700000, default: 700000, min: 200000, max: 700000}
        energy_millijoules: 98765432100
        fan_speed_percent: 30
        clocks_mhz: {graphics: 1755, sm: 1755, memory: 3201}
        max_clocks_mhz: {graphics: 1980, sm: 1980, memory: 3201}
        clocks_event_reasons: [sw_power_cap]     # names as in exporter.sources.nvml
        pcie_link: {generation: 5, width: 16}
        pcie_replay_counter: 0
        ecc_errors: {corrected: 2, uncorrected: 0}   # aggregate counters
        retired_pages: {single_bit_ecc: 0, double_bit_ecc: 0, pending: false}
        remapped_rows: {correctable: 0, uncorrectable: 0, pending: false, failed: false}
        xid_events: [13, 79]          # delivered once each through the event-set API
        processes: [{pid: 4242, used_bytes: 21474836480}]   # compute processes (default none)
        mps_processes: [{pid: 4343, used_bytes: 1073741824}] # MPS clients (default none)
        not_supported: [fan_speed_percent]   # these keys raise NOT_SUPPORTED
        no_permission: [processes]    # these keys raise NO_PERMISSION (a caller without root)
        lost_after_calls: 40          # GPU_IS_LOST after 40 device calls; gone after re-init
        hang: {call: nvmlDeviceGetPowerUsage, seconds: 3, times: 1}

A data key that is left out is not supported either (NOT_SUPPORTED, as on a card without that
sensor).

`nvmlDeviceSetPowerManagementLimit` (gpu-fleet-node's `power-cap`) checks the limit against the
GPU's `min`/`max` (INVALID_ARGUMENT outside, as NVML does; NO_PERMISSION when the GPU has
`power_limit_read_only: true`, as for a caller without root) and records the new enforced
limit in a settings file beside the scenario, `<scenario>.settings.json`
(`{"0000:41:00.0": {"enforced_power_limit_milliwatts": 450000}}`): the scenario file stays as
written, and every process using the same scenario (an exporter, the next gpu-fleet-node)
sees the new limit, as they would see a real card's. Delete the settings file to reset.

The scenario file is re-read when it changes, so editing a value shows on the next scrape, and
appending to `xid_events` delivers the new Xids. A GPU stays lost until the next fresh
`nvmlInit`; it comes back then only if the file no longer makes it lost.
"""

from __future__ import annotations

import ctypes
import json
import logging
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar

import pynvml
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from exporter.sources.nvml import (
    CLOCKS_EVENT_REASONS,
    COMPUTE_MODES,
    EventData,
    FieldValue,
    MemoryInfo,
    PciInfo,
    Utilization,
    handle_key,
)
from fleet.gpu_index import normalize_pci_bus_id

log = logging.getLogger(__name__)

T = TypeVar("T")


class ScenarioError(ValueError):
    """The scenario file cannot be used; the message names the file and every bad key path."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class UtilizationScenario(_Strict):
    """`utilization_percent`."""

    gpu: int = Field(ge=0, le=100)
    memory: int = Field(ge=0, le=100)


class MemoryScenario(_Strict):
    """`memory_bytes`: `used` is allocated memory, `reserved` the driver's (v2 meanings)."""

    total: int = Field(ge=0)
    used: int = Field(ge=0)
    reserved: int = Field(default=0, ge=0)

    @model_validator(mode="after")
    def _fits(self) -> MemoryScenario:
        if self.used + self.reserved > self.total:
            raise ValueError("used + reserved exceeds total")
        return self


class ThresholdsScenario(_Strict):
    """`temperature_thresholds_celsius`; a threshold left out is not supported."""

    shutdown: int | None = None
    slowdown: int | None = None
    mem_max: int | None = None


class PowerLimitsScenario(_Strict):
    """`power_limit_milliwatts`; a limit left out is not supported."""

    enforced: int | None = None
    default: int | None = None
    min: int | None = None
    max: int | None = None

    @model_validator(mode="after")
    def _constraints_pair(self) -> PowerLimitsScenario:
        # One NVML call answers both (nvmlDeviceGetPowerManagementLimitConstraints).
        if (self.min is None) != (self.max is None):
            raise ValueError("min and max come together or not at all")
        return self


class ClocksScenario(_Strict):
    """`clocks_mhz` / `max_clocks_mhz`; a clock left out is not supported."""

    graphics: int | None = None
    sm: int | None = None
    memory: int | None = None
    video: int | None = None


class PcieLinkScenario(_Strict):
    """`pcie_link`: the current link."""

    generation: int | None = None
    width: int | None = None


class EccScenario(_Strict):
    """`ecc_errors`: aggregate (lifetime) counters."""

    corrected: int = Field(ge=0)
    uncorrected: int = Field(ge=0)


class RetiredPagesScenario(_Strict):
    """`retired_pages`: page counts by cause, and whether one waits for a driver reload."""

    single_bit_ecc: int = Field(default=0, ge=0)
    double_bit_ecc: int = Field(default=0, ge=0)
    pending: bool = False


class RemappedRowsScenario(_Strict):
    """`remapped_rows`, as `nvmlDeviceGetRemappedRows` reports them."""

    correctable: int = Field(default=0, ge=0)
    uncorrectable: int = Field(default=0, ge=0)
    pending: bool = False
    failed: bool = False


class HangScenario(_Strict):
    """`hang`: the first `times` calls of `call` on this GPU sleep `seconds` before answering."""

    call: str
    seconds: float = Field(gt=0)
    times: int = Field(default=1, ge=1)


# Keys of a GPU that are not data (and so cannot be listed in `not_supported`).
_CONTROL_KEYS = frozenset(
    {
        "pci_bus_id",
        "pci_device_id",
        "pci_subsystem_id",
        "not_supported",
        "no_permission",
        "lost_after_calls",
        "hang",
        "power_limit_read_only",
    }
)


class ProcessScenario(_Strict):
    """One entry of `processes` / `mps_processes`: a pid and the GPU memory it holds."""

    pid: int = Field(ge=1)
    used_bytes: int | None = Field(default=None, ge=0)  # None: NVML cannot say (WDDM, MIG)


class GpuScenario(_Strict):
    """One GPU of a scenario; see the module docstring for the keys."""

    pci_bus_id: str
    pci_device_id: int = Field(ge=0, le=0xFFFFFFFF)
    pci_subsystem_id: int = Field(default=0, ge=0, le=0xFFFFFFFF)
    name: str | None = None
    uuid: str | None = None
    vbios_version: str | None = None
    compute_mode: str | None = None
    utilization_percent: UtilizationScenario | None = None
    memory_bytes: MemoryScenario | None = None
    temperature_celsius: int | None = None
    memory_temperature_celsius: int | None = None
    temperature_thresholds_celsius: ThresholdsScenario | None = None
    power_usage_milliwatts: int | None = Field(default=None, ge=0)
    power_limit_milliwatts: PowerLimitsScenario | None = None
    energy_millijoules: int | None = Field(default=None, ge=0)
    fan_speed_percent: int | None = Field(default=None, ge=0)
    clocks_mhz: ClocksScenario | None = None
    max_clocks_mhz: ClocksScenario | None = None
    clocks_event_reasons: list[str] | None = None
    pcie_link: PcieLinkScenario | None = None
    pcie_replay_counter: int | None = Field(default=None, ge=0)
    ecc_errors: EccScenario | None = None
    retired_pages: RetiredPagesScenario | None = None
    remapped_rows: RemappedRowsScenario | None = None
    xid_events: list[int] = Field(default_factory=list)
    processes: list[ProcessScenario] = Field(default_factory=list)
    mps_processes: list[ProcessScenario] = Field(default_factory=list)
    not_supported: list[str] = Field(default_factory=list)
    no_permission: list[str] = Field(default_factory=list)
    lost_after_calls: int | None = Field(default=None, ge=0)
    hang: HangScenario | None = None
    power_limit_read_only: bool = False

    @field_validator("pci_bus_id")
    @classmethod
    def _bus_id(cls, value: str) -> str:
        return normalize_pci_bus_id(value)

    @field_validator("compute_mode")
    @classmethod
    def _compute_mode(cls, value: str | None) -> str | None:
        if value is not None and value not in COMPUTE_MODES:
            raise ValueError(f"must be one of {', '.join(COMPUTE_MODES)}")
        return value

    @field_validator("clocks_event_reasons")
    @classmethod
    def _reasons(cls, value: list[str] | None) -> list[str] | None:
        unknown = sorted(set(value or ()) - set(CLOCKS_EVENT_REASONS))
        if unknown:
            raise ValueError(f"unknown {unknown}; known: {', '.join(CLOCKS_EVENT_REASONS)}")
        return value

    @model_validator(mode="after")
    def _not_supported_names_data(self) -> GpuScenario:
        data_keys = set(type(self).model_fields) - _CONTROL_KEYS
        for key in ("not_supported", "no_permission"):
            unknown = sorted(set(getattr(self, key)) - data_keys)
            if unknown:
                raise ValueError(f"{key}: unknown keys {unknown}")
        return self


class Scenario(_Strict):
    """A whole scenario file."""

    library_missing: bool = False
    gpus: list[GpuScenario] = Field(default_factory=list)

    @model_validator(mode="after")
    def _unique_bus_ids(self) -> Scenario:
        bus_ids = [gpu.pci_bus_id for gpu in self.gpus]
        duplicates = sorted({b for b in bus_ids if bus_ids.count(b) > 1})
        if duplicates:
            raise ValueError(f"gpus: duplicate pci_bus_id {duplicates}")
        return self


def load_scenario(path: Path) -> Scenario:
    """Read and validate a scenario file; `ScenarioError` names every bad key path."""
    try:
        raw = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as err:
        raise ScenarioError(f"{path}: {err}") from err
    try:
        scenario = Scenario.model_validate(raw if raw is not None else {})
    except ValidationError as err:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or '(top)'}: {e['msg']}" for e in err.errors()
        )
        raise ScenarioError(f"{path}: {problems}") from None
    hangable = _device_calls()
    for i, gpu in enumerate(scenario.gpus):
        if gpu.hang is not None and gpu.hang.call not in hangable:
            raise ScenarioError(
                f"{path}: gpus.{i}.hang.call: {gpu.hang.call!r} is not a device call of the fake"
            )
    return scenario


def _device_calls() -> set[str]:
    """The fake's methods that take a device handle (the ones a `hang` can stall)."""
    by_index = {"nvmlDeviceGetCount", "nvmlDeviceGetHandleByIndex"}
    return {name for name in dir(FakeNvml) if name.startswith("nvmlDevice")} - by_index


def _nvml_bus_id(bus_id: str) -> str:
    """NVML's spelling of a PCI bus id: 8-digit domain, upper case (`00000000:41:00.0`)."""
    domain, bus, devfn = bus_id.split(":")
    return f"{int(domain, 16):08X}:{bus.upper()}:{devfn.upper()}"


def _fail(code: int) -> pynvml.NVMLError:
    # pynvml.NVMLError(code) returns the subclass for the code (NVMLError_NotSupported, ...):
    # the fake's errors are the very classes the real library raises.
    return pynvml.NVMLError(code)


def _supported(gpu: GpuScenario, key: str, value: T | None) -> T:
    if key in gpu.no_permission:
        raise _fail(pynvml.NVML_ERROR_NO_PERMISSION)
    if value is None or key in gpu.not_supported:
        raise _fail(pynvml.NVML_ERROR_NOT_SUPPORTED)
    return value


def _processes(gpu: GpuScenario, key: str, entries: list[ProcessScenario]) -> list[Any]:
    if key in gpu.no_permission:
        raise _fail(pynvml.NVML_ERROR_NO_PERMISSION)
    if key in gpu.not_supported:
        raise _fail(pynvml.NVML_ERROR_NOT_SUPPORTED)
    # pynvml hands back nvmlFriendlyObject instances (attributes, not ctypes fields) and
    # turns NVML_VALUE_NOT_AVAILABLE into usedGpuMemory=None; the fake does the same.
    no_instance = 0xFFFFFFFF  # NVML's "not a MIG instance"
    return [
        pynvml.nvmlFriendlyObject(
            {
                "pid": entry.pid,
                "usedGpuMemory": entry.used_bytes,
                "gpuInstanceId": no_instance,
                "computeInstanceId": no_instance,
            }
        )
        for entry in entries
    ]


def _opaque(pointer_type: type[ctypes._Pointer[Any]], keep: list[object]) -> object:
    """A distinct non-null pointer of one of pynvml's opaque handle types."""
    backing = ctypes.create_string_buffer(1)
    keep.append(backing)  # addresses must stay unique for the fake's lifetime
    return ctypes.cast(backing, pointer_type)


class _EventSet:
    def __init__(self, pointer: object) -> None:
        self.pointer = pointer
        self.buses: list[str] = []
        self.freed = False


_THRESHOLDS = {
    pynvml.NVML_TEMPERATURE_THRESHOLD_SHUTDOWN: "shutdown",
    pynvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN: "slowdown",
    pynvml.NVML_TEMPERATURE_THRESHOLD_MEM_MAX: "mem_max",
}
_CLOCKS = {
    pynvml.NVML_CLOCK_GRAPHICS: "graphics",
    pynvml.NVML_CLOCK_SM: "sm",
    pynvml.NVML_CLOCK_MEM: "memory",
    pynvml.NVML_CLOCK_VIDEO: "video",
}


class FakeNvml:
    """A STAND-IN for a GPU driven by a scenario file: pynvml's calls, not a GPU's data."""

    def __init__(self, scenario: Path) -> None:
        self._path = Path(scenario)
        self._lock = threading.RLock()
        self._scenario = load_scenario(self._path)
        self._stamp = self._file_stamp()
        self._reload_error = ""
        self._refcount = 0
        self._generation = 0
        self._enumerated: list[str] = []
        self._keep: list[object] = []
        self._handles: dict[int, tuple[int, str]] = {}  # address -> (generation, bus id)
        self._current: dict[str, object] = {}  # bus id -> handle of this generation
        self._event_sets: dict[int, _EventSet] = {}
        self._calls: dict[str, int] = {}
        self._lost: set[str] = set()
        self._hangs_done: dict[str, int] = {}
        self._xids_delivered: dict[str, int] = {}
        self._release = threading.Event()
        # Power limits set through nvmlDeviceSetPowerManagementLimit, shared between processes.
        self._settings_path = Path(str(self._path) + ".settings.json")

    # -- test and demo controls (not NVML) ---------------------------------------------------

    def release_hangs(self) -> None:
        """End the hang in progress and every later one at once (tests need no long sleeps)."""
        self._release.set()

    # -- library ------------------------------------------------------------------------------

    def nvmlInit(self) -> None:
        """Take a reference; the first one enumerates the GPUs that are not lost."""
        with self._lock:
            self._reload_if_changed()
            if self._scenario.library_missing:
                raise _fail(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)
            if self._refcount == 0:
                self._fresh_init()
            self._refcount += 1

    def nvmlShutdown(self) -> None:
        """Drop a reference; at zero every handle and event set becomes invalid."""
        with self._lock:
            self._require_init()
            self._refcount -= 1

    def nvmlDeviceGetCount(self) -> int:
        """GPUs enumerated by the last fresh `nvmlInit`."""
        with self._lock:
            self._require_init()
            return len(self._enumerated)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> object:
        """NVML's index is the order of the scenario file, not the PCI bus order."""
        with self._lock:
            self._require_init()
            self._reload_if_changed()
            if not 0 <= index < len(self._enumerated):
                raise _fail(pynvml.NVML_ERROR_INVALID_ARGUMENT)
            bus_id = self._enumerated[index]
            self._gpu(bus_id)
            if bus_id in self._lost:
                raise _fail(pynvml.NVML_ERROR_GPU_IS_LOST)
            return self._current[bus_id]

    # -- identity -----------------------------------------------------------------------------

    def nvmlDeviceGetPciInfo(self, handle: object) -> PciInfo:
        """`nvmlPciInfo_t`, `busId` in NVML's 8-digit-domain form."""
        gpu = self._device(handle, "nvmlDeviceGetPciInfo")
        domain, bus, devfn = (int(p, 16) for p in gpu.pci_bus_id.replace(".", ":").split(":")[:3])
        info = pynvml.nvmlPciInfo_t()
        info.busIdLegacy = f"{domain:04X}:{bus:02X}:{devfn:02X}.0"
        info.domain = domain
        info.bus = bus
        info.device = devfn
        info.pciDeviceId = gpu.pci_device_id
        info.pciSubSystemId = gpu.pci_subsystem_id
        info.busId = _nvml_bus_id(gpu.pci_bus_id)
        result: PciInfo = info
        return result

    def nvmlDeviceGetName(self, handle: object) -> str:
        """Product name (`str`: pynvml decodes it)."""
        gpu = self._device(handle, "nvmlDeviceGetName")
        return _supported(gpu, "name", gpu.name)

    def nvmlDeviceGetUUID(self, handle: object) -> str:
        """`GPU-...`."""
        gpu = self._device(handle, "nvmlDeviceGetUUID")
        return _supported(gpu, "uuid", gpu.uuid)

    def nvmlDeviceGetVbiosVersion(self, handle: object) -> str:
        """VBIOS version."""
        gpu = self._device(handle, "nvmlDeviceGetVbiosVersion")
        return _supported(gpu, "vbios_version", gpu.vbios_version)

    # -- readings -----------------------------------------------------------------------------

    def nvmlDeviceGetUtilizationRates(self, handle: object) -> Utilization:
        """`c_nvmlUtilization_t`."""
        gpu = self._device(handle, "nvmlDeviceGetUtilizationRates")
        util = _supported(gpu, "utilization_percent", gpu.utilization_percent)
        result: Utilization = pynvml.c_nvmlUtilization_t(gpu=util.gpu, memory=util.memory)
        return result

    def nvmlDeviceGetMemoryInfo(self, handle: object, version: int | None = None) -> MemoryInfo:
        """v1 (`used` includes the reserved memory) or, for `nvmlMemory_v2`, v2."""
        gpu = self._device(handle, "nvmlDeviceGetMemoryInfo")
        mem = _supported(gpu, "memory_bytes", gpu.memory_bytes)
        free = mem.total - mem.used - mem.reserved
        result: MemoryInfo
        if not version:
            # nvml.h nvmlMemory_t: "used: Sum of Reserved and Allocated device memory".
            result = pynvml.c_nvmlMemory_t(total=mem.total, free=free, used=mem.used + mem.reserved)
        elif version == pynvml.nvmlMemory_v2:
            result = pynvml.c_nvmlMemory_v2_t(
                version=version, total=mem.total, reserved=mem.reserved, free=free, used=mem.used
            )
        else:
            raise _fail(pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
        return result

    def nvmlDeviceGetTemperature(self, handle: object, sensor: int) -> int:
        """Only `NVML_TEMPERATURE_GPU` exists."""
        gpu = self._device(handle, "nvmlDeviceGetTemperature")
        if sensor != pynvml.NVML_TEMPERATURE_GPU:
            raise _fail(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return _supported(gpu, "temperature_celsius", gpu.temperature_celsius)

    def nvmlDeviceGetTemperatureThreshold(self, handle: object, threshold: int) -> int:
        """Shutdown, slowdown and memory-max thresholds; others are not supported."""
        gpu = self._device(handle, "nvmlDeviceGetTemperatureThreshold")
        limits = _supported(
            gpu, "temperature_thresholds_celsius", gpu.temperature_thresholds_celsius
        )
        key = _THRESHOLDS.get(threshold)
        if key is None:
            raise _fail(pynvml.NVML_ERROR_NOT_SUPPORTED)
        value: int | None = getattr(limits, key)
        return _supported(gpu, "temperature_thresholds_celsius", value)

    def nvmlDeviceGetFieldValues(
        self,
        handle: object,
        fieldIds: Sequence[int | tuple[int, int]],
    ) -> Sequence[FieldValue]:
        """An array of `c_nvmlFieldValue_t`; each field fails on its own via `nvmlReturn`."""
        gpu = self._device(handle, "nvmlDeviceGetFieldValues")
        values = (pynvml.c_nvmlFieldValue_t * len(fieldIds))()
        now_us = int(time.time() * 1e6)
        for i, field in enumerate(fieldIds):
            field_id, scope_id = field if isinstance(field, tuple) else (field, 0)
            values[i].fieldId = field_id
            values[i].scopeId = scope_id
            values[i].timestamp = now_us
            temp = gpu.memory_temperature_celsius
            if (
                field_id == pynvml.NVML_FI_DEV_MEMORY_TEMP
                and temp is not None
                and ("memory_temperature_celsius" not in gpu.not_supported)
            ):
                values[i].valueType = pynvml.NVML_VALUE_TYPE_UNSIGNED_INT
                values[i].value.uiVal = temp
                values[i].nvmlReturn = pynvml.NVML_SUCCESS
            else:
                values[i].nvmlReturn = pynvml.NVML_ERROR_NOT_SUPPORTED
        result: Sequence[FieldValue] = values
        return result

    def nvmlDeviceGetPowerUsage(self, handle: object) -> int:
        """Draw, mW."""
        gpu = self._device(handle, "nvmlDeviceGetPowerUsage")
        return _supported(gpu, "power_usage_milliwatts", gpu.power_usage_milliwatts)

    def nvmlDeviceGetEnforcedPowerLimit(self, handle: object) -> int:
        """The limit in force, mW: the last one set, else the scenario's."""
        gpu = self._device(handle, "nvmlDeviceGetEnforcedPowerLimit")
        limits = _supported(gpu, "power_limit_milliwatts", gpu.power_limit_milliwatts)
        enforced = _supported(gpu, "power_limit_milliwatts", limits.enforced)
        setting = self._settings().get(gpu.pci_bus_id, {}).get("enforced_power_limit_milliwatts")
        return int(setting) if isinstance(setting, int) else enforced

    def nvmlDeviceSetPowerManagementLimit(self, handle: object, limit: int) -> None:
        """Record a new enforced limit (mW) in the settings file, within `min`..`max`."""
        gpu = self._device(handle, "nvmlDeviceSetPowerManagementLimit")
        limits = _supported(gpu, "power_limit_milliwatts", gpu.power_limit_milliwatts)
        low = _supported(gpu, "power_limit_milliwatts", limits.min)
        high = _supported(gpu, "power_limit_milliwatts", limits.max)
        if gpu.power_limit_read_only:
            raise _fail(pynvml.NVML_ERROR_NO_PERMISSION)
        if not low <= limit <= high:
            raise _fail(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        with self._lock:
            settings = self._settings()
            settings.setdefault(gpu.pci_bus_id, {})["enforced_power_limit_milliwatts"] = limit
            temporary = self._settings_path.with_name(self._settings_path.name + ".tmp")
            temporary.write_text(json.dumps(settings, indent=2) + "\n")
            temporary.replace(self._settings_path)  # atomic: another process never reads half

    def _settings(self) -> dict[str, dict[str, Any]]:
        try:
            data = json.loads(self._settings_path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as err:
            log.warning("fake NVML ignores its settings file %s: %s", self._settings_path, err)
            return {}
        return data if isinstance(data, dict) else {}

    def nvmlDeviceGetPowerManagementDefaultLimit(self, handle: object) -> int:
        """The default limit, mW."""
        gpu = self._device(handle, "nvmlDeviceGetPowerManagementDefaultLimit")
        limits = _supported(gpu, "power_limit_milliwatts", gpu.power_limit_milliwatts)
        return _supported(gpu, "power_limit_milliwatts", limits.default)

    def nvmlDeviceGetPowerManagementLimitConstraints(self, handle: object) -> Sequence[int]:
        """`[min, max]` mW, a list as pynvml returns it."""
        gpu = self._device(handle, "nvmlDeviceGetPowerManagementLimitConstraints")
        limits = _supported(gpu, "power_limit_milliwatts", gpu.power_limit_milliwatts)
        low = _supported(gpu, "power_limit_milliwatts", limits.min)
        high = _supported(gpu, "power_limit_milliwatts", limits.max)
        return [low, high]

    def nvmlDeviceGetTotalEnergyConsumption(self, handle: object) -> int:
        """Energy since the driver loaded, mJ."""
        gpu = self._device(handle, "nvmlDeviceGetTotalEnergyConsumption")
        return _supported(gpu, "energy_millijoules", gpu.energy_millijoules)

    def nvmlDeviceGetFanSpeed(self, handle: object) -> int:
        """Percent."""
        gpu = self._device(handle, "nvmlDeviceGetFanSpeed")
        return _supported(gpu, "fan_speed_percent", gpu.fan_speed_percent)

    def nvmlDeviceGetClockInfo(self, handle: object, type: int) -> int:
        """MHz."""
        gpu = self._device(handle, "nvmlDeviceGetClockInfo")
        return self._clock(gpu, "clocks_mhz", gpu.clocks_mhz, type)

    def nvmlDeviceGetMaxClockInfo(self, handle: object, type: int) -> int:
        """MHz."""
        gpu = self._device(handle, "nvmlDeviceGetMaxClockInfo")
        return self._clock(gpu, "max_clocks_mhz", gpu.max_clocks_mhz, type)

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: object) -> int:
        """Bit mask of pynvml's `nvmlClocksEventReason*`."""
        gpu = self._device(handle, "nvmlDeviceGetCurrentClocksEventReasons")
        reasons = _supported(gpu, "clocks_event_reasons", gpu.clocks_event_reasons)
        mask = 0
        for reason in reasons:
            mask |= CLOCKS_EVENT_REASONS[reason]
        return mask

    def nvmlDeviceGetCurrPcieLinkGeneration(self, handle: object) -> int:
        """Current generation."""
        gpu = self._device(handle, "nvmlDeviceGetCurrPcieLinkGeneration")
        link = _supported(gpu, "pcie_link", gpu.pcie_link)
        return _supported(gpu, "pcie_link", link.generation)

    def nvmlDeviceGetCurrPcieLinkWidth(self, handle: object) -> int:
        """Current lanes."""
        gpu = self._device(handle, "nvmlDeviceGetCurrPcieLinkWidth")
        link = _supported(gpu, "pcie_link", gpu.pcie_link)
        return _supported(gpu, "pcie_link", link.width)

    def nvmlDeviceGetPcieReplayCounter(self, handle: object) -> int:
        """Replays."""
        gpu = self._device(handle, "nvmlDeviceGetPcieReplayCounter")
        return _supported(gpu, "pcie_replay_counter", gpu.pcie_replay_counter)

    def nvmlDeviceGetTotalEccErrors(
        self,
        handle: object,
        errorType: int,
        counterType: int,
    ) -> int:
        """Aggregate counters only: scenarios hold no volatile ones (NOT_SUPPORTED)."""
        gpu = self._device(handle, "nvmlDeviceGetTotalEccErrors")
        ecc = _supported(gpu, "ecc_errors", gpu.ecc_errors)
        if counterType not in (pynvml.NVML_VOLATILE_ECC, pynvml.NVML_AGGREGATE_ECC):
            raise _fail(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if counterType != pynvml.NVML_AGGREGATE_ECC:
            raise _fail(pynvml.NVML_ERROR_NOT_SUPPORTED)
        if errorType == pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED:
            return ecc.corrected
        if errorType == pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED:
            return ecc.uncorrected
        raise _fail(pynvml.NVML_ERROR_INVALID_ARGUMENT)

    def nvmlDeviceGetRetiredPages(self, device: object, sourceFilter: int) -> Sequence[int]:
        """Made-up page addresses, as many as the scenario counts for the cause."""
        gpu = self._device(device, "nvmlDeviceGetRetiredPages")
        pages = _supported(gpu, "retired_pages", gpu.retired_pages)
        if sourceFilter == pynvml.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS:
            count = pages.single_bit_ecc
        elif sourceFilter == pynvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR:
            count = pages.double_bit_ecc
        else:
            raise _fail(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return [0x1000 * (i + 1) for i in range(count)]

    def nvmlDeviceGetRetiredPagesPendingStatus(self, device: object) -> int:
        """1 when a retirement waits for a driver reload."""
        gpu = self._device(device, "nvmlDeviceGetRetiredPagesPendingStatus")
        pages = _supported(gpu, "retired_pages", gpu.retired_pages)
        return int(pages.pending)

    def nvmlDeviceGetRemappedRows(self, device: object) -> tuple[int, int, int, int]:
        """`(correctable, uncorrectable, pending, failure)`, a tuple as pynvml returns it."""
        gpu = self._device(device, "nvmlDeviceGetRemappedRows")
        rows = _supported(gpu, "remapped_rows", gpu.remapped_rows)
        return (rows.correctable, rows.uncorrectable, int(rows.pending), int(rows.failed))

    def nvmlDeviceGetComputeMode(self, handle: object) -> int:
        """`NVML_COMPUTEMODE_*`."""
        gpu = self._device(handle, "nvmlDeviceGetComputeMode")
        return COMPUTE_MODES[_supported(gpu, "compute_mode", gpu.compute_mode)]

    def nvmlDeviceGetComputeRunningProcesses(self, handle: object) -> list[Any]:
        """Friendly objects with `pid`, `usedGpuMemory` (None when not available)."""
        gpu = self._device(handle, "nvmlDeviceGetComputeRunningProcesses")
        return _processes(gpu, "processes", gpu.processes)

    def nvmlDeviceGetMPSComputeRunningProcesses(self, handle: object) -> list[Any]:
        """MPS clients, shaped like the compute processes."""
        gpu = self._device(handle, "nvmlDeviceGetMPSComputeRunningProcesses")
        return _processes(gpu, "mps_processes", gpu.mps_processes)

    # -- events -------------------------------------------------------------------------------

    def nvmlEventSetCreate(self) -> object:
        """A `c_nvmlEventSet_t` pointer."""
        with self._lock:
            self._require_init()
            pointer = _opaque(pynvml.c_nvmlEventSet_t, self._keep)
            self._event_sets[handle_key(pointer)] = _EventSet(pointer)
            return pointer

    def nvmlDeviceRegisterEvents(
        self,
        handle: object,
        eventTypes: int,
        eventSet: object,
    ) -> None:
        """Only Xid events exist here; `not_supported: [xid_events]` refuses them."""
        gpu = self._device(handle, "nvmlDeviceRegisterEvents")
        with self._lock:
            events = self._event_set(eventSet)
            if "xid_events" in gpu.not_supported:
                raise _fail(pynvml.NVML_ERROR_NOT_SUPPORTED)
            if eventTypes & ~pynvml.nvmlEventTypeXidCriticalError:
                raise _fail(pynvml.NVML_ERROR_NOT_SUPPORTED)
            if gpu.pci_bus_id not in events.buses:
                events.buses.append(gpu.pci_bus_id)

    def nvmlEventSetWait_v2(self, eventSet: object, timeoutms: int) -> EventData:
        """The next undelivered Xid of a registered GPU, else TIMEOUT after `timeoutms`."""
        data = self._next_event(eventSet)
        if data is None:
            time.sleep(timeoutms / 1000)
            data = self._next_event(eventSet)
        if data is None:
            raise _fail(pynvml.NVML_ERROR_TIMEOUT)
        return data

    def nvmlEventSetFree(self, eventSet: object) -> None:
        """Release the set."""
        with self._lock:
            self._require_init()
            self._event_set(eventSet).freed = True

    # -- internals ----------------------------------------------------------------------------

    def _file_stamp(self) -> tuple[int, int]:
        stat = self._path.stat()
        return (stat.st_mtime_ns, stat.st_size)

    def _reload_if_changed(self) -> None:
        try:
            stamp = self._file_stamp()
        except OSError:
            return  # a file being replaced: keep the last scenario
        if stamp == self._stamp:
            return
        try:
            scenario = load_scenario(self._path)
        except ScenarioError as err:
            # Half-written by an editor, or a mistake: keep the last good scenario and retry on
            # the next call (the stamp is not taken), logging each new complaint once.
            if str(err) != self._reload_error:
                log.warning("fake NVML keeps its previous scenario: %s", err)
                self._reload_error = str(err)
            return
        self._scenario, self._stamp, self._reload_error = scenario, stamp, ""

    def _require_init(self) -> None:
        if self._refcount <= 0:
            raise _fail(pynvml.NVML_ERROR_UNINITIALIZED)

    def _is_lost_by_file(self, gpu: GpuScenario) -> bool:
        limit = gpu.lost_after_calls
        return limit is not None and self._calls.get(gpu.pci_bus_id, 0) >= limit

    def _fresh_init(self) -> None:
        self._generation += 1
        gpus = self._scenario.gpus
        # A lost GPU is gone from the bus: a fresh init no longer enumerates it (and it comes
        # back only if the file no longer makes it lost).
        self._lost = {gpu.pci_bus_id for gpu in gpus if self._is_lost_by_file(gpu)}
        self._enumerated = [gpu.pci_bus_id for gpu in gpus if gpu.pci_bus_id not in self._lost]
        self._current = {}
        for bus_id in self._enumerated:
            handle = _opaque(pynvml.c_nvmlDevice_t, self._keep)
            self._handles[handle_key(handle)] = (self._generation, bus_id)
            self._current[bus_id] = handle
        self._event_sets = {}

    def _gpu(self, bus_id: str) -> GpuScenario:
        for gpu in self._scenario.gpus:
            if gpu.pci_bus_id == bus_id:
                return gpu
        # Taken out of the file while enumerated: as if it fell off the bus.
        self._lost.add(bus_id)
        raise _fail(pynvml.NVML_ERROR_GPU_IS_LOST)

    def _device(self, handle: object, call: str) -> GpuScenario:
        """The GPU behind a handle, after the checks every device call makes."""
        with self._lock:
            self._require_init()
            self._reload_if_changed()
            generation, bus_id = self._handles.get(handle_key(handle), (-1, ""))
            if generation != self._generation:
                # Unknown, or from before a fresh init: NVML's handles do not outlive it.
                raise _fail(pynvml.NVML_ERROR_INVALID_ARGUMENT)
            gpu = self._gpu(bus_id)
            if bus_id in self._lost:
                raise _fail(pynvml.NVML_ERROR_GPU_IS_LOST)
            self._calls[bus_id] = self._calls.get(bus_id, 0) + 1
            limit = gpu.lost_after_calls
            if limit is not None and self._calls[bus_id] > limit:
                self._lost.add(bus_id)
                raise _fail(pynvml.NVML_ERROR_GPU_IS_LOST)
            hang = gpu.hang
            if hang is not None and hang.call == call:
                done = self._hangs_done.get(bus_id, 0)
                if done >= hang.times:
                    hang = None
                else:
                    self._hangs_done[bus_id] = done + 1
            else:
                hang = None
        if hang is not None:
            # Outside the lock, like a driver call stuck in the kernel; release_hangs() ends it.
            self._release.wait(hang.seconds)
        return gpu

    def _clock(
        self, gpu: GpuScenario, key: str, clocks: ClocksScenario | None, clock_type: int
    ) -> int:
        table = _supported(gpu, key, clocks)
        name = _CLOCKS.get(clock_type)
        if name is None:
            raise _fail(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        value: int | None = getattr(table, name)
        return _supported(gpu, key, value)

    def _event_set(self, event_set: object) -> _EventSet:
        events = self._event_sets.get(handle_key(event_set))
        if events is None or events.freed:
            raise _fail(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return events

    def _next_event(self, event_set: object) -> EventData | None:
        with self._lock:
            self._require_init()
            self._reload_if_changed()
            events = self._event_set(event_set)
            for bus_id in events.buses:
                gpu = next((g for g in self._scenario.gpus if g.pci_bus_id == bus_id), None)
                delivered = self._xids_delivered.get(bus_id, 0)
                if gpu is None or delivered >= len(gpu.xid_events):
                    continue
                self._xids_delivered[bus_id] = delivered + 1
                data = pynvml.c_nvmlEventData_t()
                data.device = self._current[bus_id]
                data.eventType = pynvml.nvmlEventTypeXidCriticalError
                data.eventData = gpu.xid_events[delivered]
                # nvml.h nvmlEventData_t: 0xFFFFFFFF unless a MIG instance caused the Xid.
                data.gpuInstanceId = 0xFFFFFFFF
                data.computeInstanceId = 0xFFFFFFFF
                result: EventData = data
                return result
            return None
