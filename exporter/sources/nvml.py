"""The NVML backend: the real `pynvml` module, or a stand-in for tests and demos.

`load_backend()` returns the module of `nvidia-ml-py` (import name `pynvml`) in production, or
a `FakeNvml` driven by a scenario file when `--nvml.fake-scenario` is given. Both are used
through `NvmlBackend`, which names the NVML functions the NVIDIA collector calls with pynvml's
own parameter names (`tests/test_nvml_parity.py` holds the fake, this protocol and the installed
pynvml to the same signatures).

NVML reports every failure as an exception of pynvml's own hierarchy: `pynvml.NVMLError(code)`
builds the subclass for the code (`NVMLError_NotSupported`, `NVMLError_GpuIsLost`, ...). The
helpers here sort those exceptions into what the collector does about them:

- not supported: the field is left out (never exported as 0 or -1);
- GPU lost: the device is unreadable (`gpufleet_gpu_up 0`) until NVML is re-initialised;
- needs re-init: the library's state is broken (shut down under us, driver reloaded);
- library missing: NVML cannot work on this host at all (no library, no kernel driver).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import pynvml

# The `mode` label of `gpufleet_gpu_compute_mode`, by pynvml's constants (nvml.h
# `nvmlComputeMode_t`; EXCLUSIVE_THREAD is deprecated since CUDA 8 but still a defined value).
COMPUTE_MODES: dict[str, int] = {
    "default": pynvml.NVML_COMPUTEMODE_DEFAULT,
    "exclusive_thread": pynvml.NVML_COMPUTEMODE_EXCLUSIVE_THREAD,
    "prohibited": pynvml.NVML_COMPUTEMODE_PROHIBITED,
    "exclusive_process": pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS,
}

# The `reason` label of `gpufleet_gpu_throttle_active`: bits of
# `nvmlDeviceGetCurrentClocksEventReasons` (nvml.h "nvmlClocksEventReasons"; the older
# "ClocksThrottleReason" names are the same bits, deprecated in CUDA 12.2).
CLOCKS_EVENT_REASONS: dict[str, int] = {
    "gpu_idle": pynvml.nvmlClocksEventReasonGpuIdle,
    "applications_clocks_setting": pynvml.nvmlClocksEventReasonApplicationsClocksSetting,
    "sw_power_cap": pynvml.nvmlClocksEventReasonSwPowerCap,
    "hw_slowdown": pynvml.nvmlClocksEventReasonHwSlowdown,
    "sync_boost": pynvml.nvmlClocksEventReasonSyncBoost,
    "sw_thermal_slowdown": pynvml.nvmlClocksEventReasonSwThermalSlowdown,
    "hw_thermal_slowdown": pynvml.nvmlClocksEventReasonHwThermalSlowdown,
    "hw_power_brake_slowdown": pynvml.nvmlClocksEventReasonHwPowerBrakeSlowdown,
    "display_clock_setting": pynvml.nvmlClocksEventReasonDisplayClockSetting,
}


# The shapes pynvml returns (ctypes structures whose char arrays pynvml decodes to `str`).
# Read-only properties, so that pynvml's structures and the fake's alike satisfy them.
class PciInfo(Protocol):
    """`nvmlPciInfo_t`, as returned by `nvmlDeviceGetPciInfo`."""

    @property
    def busId(self) -> str:
        """`00000000:41:00.0`: an 8-digit domain, upper-case hex."""
        ...

    @property
    def pciDeviceId(self) -> int:
        """Device id in the upper 16 bits, vendor id in the lower 16 (`0x233510DE`)."""
        ...


class Utilization(Protocol):
    """`c_nvmlUtilization_t`: percentages over the driver's last sample period."""

    @property
    def gpu(self) -> int:
        """Percent of time a kernel ran."""
        ...

    @property
    def memory(self) -> int:
        """Percent of time device memory was read or written."""
        ...


class MemoryInfo(Protocol):
    """`c_nvmlMemory_t` (v1), or `c_nvmlMemory_v2_t` which adds `reserved` and `version`."""

    @property
    def total(self) -> int:
        """Bytes of device memory."""
        ...

    @property
    def free(self) -> int:
        """Bytes free."""
        ...

    @property
    def used(self) -> int:
        """Bytes allocated (v2) or allocated plus reserved (v1)."""
        ...


class FieldValueUnion(Protocol):
    """`c_nvmlValue_t`: a C union; the member to read is named by the field's `valueType`."""

    @property
    def dVal(self) -> float:
        """Double."""
        ...

    @property
    def uiVal(self) -> int:
        """Unsigned int."""
        ...

    @property
    def ulVal(self) -> int:
        """Unsigned long."""
        ...

    @property
    def ullVal(self) -> int:
        """Unsigned long long."""
        ...

    @property
    def sllVal(self) -> int:
        """Signed long long."""
        ...

    @property
    def siVal(self) -> int:
        """Signed int."""
        ...

    @property
    def usVal(self) -> int:
        """Unsigned short."""
        ...


class FieldValue(Protocol):
    """`c_nvmlFieldValue_t`: one answer of `nvmlDeviceGetFieldValues`, with its own return code."""

    @property
    def fieldId(self) -> int:
        """The `NVML_FI_*` id asked for."""
        ...

    @property
    def valueType(self) -> int:
        """`NVML_VALUE_TYPE_*`: which member of `value` holds the answer."""
        ...

    @property
    def nvmlReturn(self) -> int:
        """`NVML_SUCCESS` or the error for this field alone."""
        ...

    @property
    def value(self) -> FieldValueUnion:
        """The answer."""
        ...


class EventData(Protocol):
    """`c_nvmlEventData_t`, as returned by `nvmlEventSetWait_v2`."""

    @property
    def device(self) -> object:
        """The handle of the device the event happened on."""
        ...

    @property
    def eventType(self) -> int:
        """`nvmlEventType*` bit."""
        ...

    @property
    def eventData(self) -> int:
        """For `nvmlEventTypeXidCriticalError`: the Xid."""
        ...


class NvmlBackend(Protocol):
    """The NVML functions the NVIDIA collector and gpu-fleet-node call, with pynvml's names.

    Handles and event sets are opaque (`object`): ctypes pointers in pynvml.
    """

    def nvmlInit(self) -> None:
        """Initialise NVML (reference counted)."""
        ...

    def nvmlShutdown(self) -> None:
        """Release one reference taken by `nvmlInit`."""
        ...

    def nvmlDeviceGetCount(self) -> int:
        """Number of devices NVML enumerated."""
        ...

    def nvmlDeviceGetHandleByIndex(self, index: int) -> object:
        """The handle of NVML's device `index` (not our `gpu` index)."""
        ...

    def nvmlDeviceGetPciInfo(self, handle: object) -> PciInfo:
        """PCI identity."""
        ...

    def nvmlDeviceGetName(self, handle: object) -> str:
        """Product name."""
        ...

    def nvmlDeviceGetUUID(self, handle: object) -> str:
        """`GPU-...` UUID."""
        ...

    def nvmlDeviceGetVbiosVersion(self, handle: object) -> str:
        """VBIOS version string."""
        ...

    def nvmlDeviceGetUtilizationRates(self, handle: object) -> Utilization:
        """GPU and memory utilisation, percent."""
        ...

    def nvmlDeviceGetMemoryInfo(self, handle: object, version: int | None = None) -> MemoryInfo:
        """Memory in bytes; `version=pynvml.nvmlMemory_v2` adds `reserved`."""
        ...

    def nvmlDeviceGetTemperature(self, handle: object, sensor: int) -> int:
        """Temperature of `NVML_TEMPERATURE_GPU`, °C."""
        ...

    def nvmlDeviceGetTemperatureThreshold(self, handle: object, threshold: int) -> int:
        """`NVML_TEMPERATURE_THRESHOLD_*`, °C."""
        ...

    def nvmlDeviceGetFieldValues(
        self, handle: object, fieldIds: Sequence[int | tuple[int, int]]
    ) -> Sequence[FieldValue]:
        """One `FieldValue` per id asked for, in order."""
        ...

    def nvmlDeviceGetPowerUsage(self, handle: object) -> int:
        """Draw, mW."""
        ...

    def nvmlDeviceGetEnforcedPowerLimit(self, handle: object) -> int:
        """The limit in force, mW."""
        ...

    def nvmlDeviceGetPowerManagementDefaultLimit(self, handle: object) -> int:
        """The default limit, mW."""
        ...

    def nvmlDeviceGetPowerManagementLimitConstraints(self, handle: object) -> Sequence[int]:
        """`[min, max]` settable limit, mW."""
        ...

    def nvmlDeviceSetPowerManagementLimit(self, handle: object, limit: int) -> None:
        """Set the power limit, mW, within the constraints (root only); gpu-fleet-node only."""
        ...

    def nvmlDeviceGetTotalEnergyConsumption(self, handle: object) -> int:
        """Energy since the driver was last loaded, mJ."""
        ...

    def nvmlDeviceGetFanSpeed(self, handle: object) -> int:
        """Intended fan speed, percent."""
        ...

    def nvmlDeviceGetClockInfo(self, handle: object, type: int) -> int:
        """Current clock `NVML_CLOCK_*`, MHz."""
        ...

    def nvmlDeviceGetMaxClockInfo(self, handle: object, type: int) -> int:
        """Maximum clock `NVML_CLOCK_*`, MHz."""
        ...

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: object) -> int:
        """Bit mask of `nvmlClocksEventReason*`."""
        ...

    def nvmlDeviceGetCurrPcieLinkGeneration(self, handle: object) -> int:
        """Current PCIe generation."""
        ...

    def nvmlDeviceGetCurrPcieLinkWidth(self, handle: object) -> int:
        """Current PCIe lanes."""
        ...

    def nvmlDeviceGetPcieReplayCounter(self, handle: object) -> int:
        """PCIe replays since the driver loaded."""
        ...

    def nvmlDeviceGetTotalEccErrors(
        self,
        handle: object,
        errorType: int,
        counterType: int,
    ) -> int:
        """ECC error count of a `NVML_MEMORY_ERROR_TYPE_*` and `NVML_*_ECC` counter."""
        ...

    def nvmlDeviceGetRetiredPages(
        self,
        device: object,
        sourceFilter: int,
    ) -> Sequence[int]:
        """Addresses of pages retired for a `NVML_PAGE_RETIREMENT_CAUSE_*`."""
        ...

    def nvmlDeviceGetRetiredPagesPendingStatus(self, device: object) -> int:
        """1 when a retirement waits for the next driver reload."""
        ...

    def nvmlDeviceGetRemappedRows(self, device: object) -> tuple[int, int, int, int]:
        """`(correctable, uncorrectable, pending, failure)`."""
        ...

    def nvmlDeviceGetComputeMode(self, handle: object) -> int:
        """`NVML_COMPUTEMODE_*`."""
        ...

    def nvmlDeviceGetComputeRunningProcesses(self, handle: object) -> list[Any]:
        """Compute processes: objects with `pid` and `usedGpuMemory` (bytes, or None)."""
        ...

    def nvmlDeviceGetMPSComputeRunningProcesses(self, handle: object) -> list[Any]:
        """MPS clients on an MPS host, shaped like the compute processes."""
        ...

    def nvmlEventSetCreate(self) -> object:
        """A new, empty event set."""
        ...

    def nvmlDeviceRegisterEvents(
        self,
        handle: object,
        eventTypes: int,
        eventSet: object,
    ) -> None:
        """Deliver the device's events of `eventTypes` to `eventSet`."""
        ...

    def nvmlEventSetWait_v2(
        self,
        eventSet: object,
        timeoutms: int,
    ) -> EventData:
        """The next event; raises `NVMLError_Timeout` when none came within `timeoutms`."""
        ...

    def nvmlEventSetFree(self, eventSet: object) -> None:
        """Release an event set."""
        ...


def load_backend(fake_scenario: Path | None) -> NvmlBackend:
    """The real `pynvml` module, or a `FakeNvml` (a stand-in for a GPU) for `fake_scenario`.

    Loading never touches the library: `nvmlInit` does, and the collector handles its failure
    (no NVIDIA driver on this host is a normal case). Raises `ScenarioError` for a bad scenario.
    """
    if fake_scenario is not None:
        # Imported only when asked for: production never loads the stand-in.
        from exporter.sources.nvml_fake import FakeNvml  # noqa: PLC0415

        return FakeNvml(fake_scenario)
    backend: NvmlBackend = pynvml
    return backend


def is_not_supported(err: BaseException) -> bool:
    """The device or driver lacks this field: leave it out (not 0, not -1)."""
    return isinstance(err, pynvml.NVMLError_NotSupported)


def is_gpu_lost(err: BaseException) -> bool:
    """The device cannot be used until it is reset: it fell off the bus or needs a reset.

    nvml.h: GPU_IS_LOST "the GPU has fallen off the bus or has otherwise become inaccessible";
    RESET_REQUIRED "the GPU requires a reset before it can be used again". Either way nothing
    it reports can be trusted, so the whole device reads as down, not a field as absent.
    """
    return isinstance(err, (pynvml.NVMLError_GpuIsLost, pynvml.NVMLError_ResetRequired))


def needs_reinit(err: BaseException) -> bool:
    """NVML's own state is broken (shut down under us, driver reloaded or upgraded underneath).

    Only `nvmlShutdown` + `nvmlInit` and fresh handles can fix that; retrying the call cannot.
    """
    return isinstance(
        err,
        (
            pynvml.NVMLError_Uninitialized,
            pynvml.NVMLError_DriverNotLoaded,
            pynvml.NVMLError_LibRmVersionMismatch,
        ),
    )


def is_library_missing(err: BaseException) -> bool:
    """NVML cannot work on this host: `libnvidia-ml.so.1` is absent or no driver is loaded.

    On a host without NVIDIA GPUs this is the normal answer of `nvmlInit`.
    """
    return isinstance(err, (pynvml.NVMLError_LibraryNotFound, pynvml.NVMLError_DriverNotLoaded))


def is_timeout(err: BaseException) -> bool:
    """`nvmlEventSetWait_v2` found no event within its timeout: the normal idle answer."""
    return isinstance(err, pynvml.NVMLError_Timeout)


def error_code(err: BaseException) -> int | None:
    """The NVML return code of an NVML error (`NVML_ERROR_*`), None for other exceptions."""
    value = getattr(err, "value", None) if isinstance(err, pynvml.NVMLError) else None
    return value if isinstance(value, int) else None


def field_value(field: FieldValue) -> float:
    """The number in one answer of `nvmlDeviceGetFieldValues`.

    The call as a whole succeeds while each field carries its own return code, so a field's
    failure is raised here as pynvml's own exception for that code (`NVMLError(code)` picks the
    subclass) and is classified like the failure of any other call.
    """
    if field.nvmlReturn != pynvml.NVML_SUCCESS:
        raise pynvml.NVMLError(field.nvmlReturn)
    # A C union: only the member named by valueType holds the answer (nvml.h nvmlValueType_t).
    member = _UNION_MEMBERS.get(field.valueType)
    raw: object = getattr(field.value, member) if member is not None else None
    if not isinstance(raw, (int, float)):
        raise pynvml.NVMLError(pynvml.NVML_ERROR_UNKNOWN)
    return float(raw)


_UNION_MEMBERS: dict[int, str] = {
    pynvml.NVML_VALUE_TYPE_DOUBLE: "dVal",
    pynvml.NVML_VALUE_TYPE_UNSIGNED_INT: "uiVal",
    pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG: "ulVal",
    pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG: "ullVal",
    pynvml.NVML_VALUE_TYPE_SIGNED_LONG_LONG: "sllVal",
    pynvml.NVML_VALUE_TYPE_SIGNED_INT: "siVal",
}
# NVML_VALUE_TYPE_UNSIGNED_SHORT (and the union's `usVal`) arrived in nvidia-ml-py 12.560.30;
# the declared floor lacks both, and a binding without the member cannot decode such a field
# anyway: there the field is left out as unreadable, instead of the import failing.
_UNSIGNED_SHORT: int | None = getattr(pynvml, "NVML_VALUE_TYPE_UNSIGNED_SHORT", None)
if _UNSIGNED_SHORT is not None:
    _UNION_MEMBERS[_UNSIGNED_SHORT] = "usVal"


def pci_id(pci_device_id: int) -> str:
    """`vendor:device` in lower-case hex (`10de:2335`) from NVML's packed `pciDeviceId`.

    nvml.h `nvmlPciInfo_t.pciDeviceId`: "the combined 16-bit device id and 16-bit vendor id",
    device id in the upper half.
    """
    return f"{pci_device_id & 0xFFFF:04x}:{(pci_device_id >> 16) & 0xFFFF:04x}"


def handle_key(handle: object) -> int:
    """A key for a device handle that is equal for equal handles.

    pynvml's handles are ctypes pointers, and two pointer objects to the same device (the one
    from `nvmlDeviceGetHandleByIndex`, the one in an event's `device`) never compare equal:
    compare the address they hold instead.
    """
    if isinstance(handle, ctypes._Pointer):
        address = ctypes.cast(handle, ctypes.c_void_p).value
        return address if address is not None else 0
    return id(handle)
