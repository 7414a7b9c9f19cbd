"""The GPU verbs of `gpu-fleet-node`: GPU processes for evidence, and power capping.

GPUs are numbered by the function the exporter uses (`exporter.sources.pci.number_host_gpus`):
PCI bus order over all of the host's GPUs in PCI sysfs and the roster's `pci_bus_ids`, NVIDIA
(driven through the NVML backend: the real `pynvml`, or the fake scenario stand-in under
`--nvml.fake-scenario`) and AMD (amdgpu sysfs) together. A request names the GPU by index *and*
PCI bus id (the remediator reads the bus id from `gpufleet_gpu_info` when it acts): when this
host's index -> bus id mapping differs (a card missing since the exporter numbered them), the
request is refused, so an action lands on the card the alert is about or nowhere.

Power capping (`power-cap GPU WATTS PCI_BUS_ID`, `power-cap-restore GPU PCI_BUS_ID`):

- NVIDIA: `nvmlDeviceSetPowerManagementLimit` in milliwatts, within
  `nvmlDeviceGetPowerManagementLimitConstraints`; the value in force is
  `nvmlDeviceGetEnforcedPowerLimit`. Needs root.
- AMD: hwmon `power1_cap` in microwatts, within `power1_cap_min`/`power1_cap_max`
  (Documentation/gpu/amdgpu/thermal.rst). Needs root.
- Only within the roster's `power_cap_watts` bounds (by bus id, else by index) *and* the
  device's own; the value in
  force before the first change is recorded in `<state-dir>/power-cap-gpu<N>.json` (written
  atomically, before the change), so that `power-cap-restore` sets it back and removes the
  record; later caps keep the first record. A restore without a record has nothing to do.

Manual check: `nvidia-smi -q -d POWER`, `cat /sys/class/drm/card0/device/hwmon/hwmon*/power1_cap`.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import pynvml

from exporter.node.protocol import Failed, Refused
from exporter.sources import drm_fdinfo
from exporter.sources.amdgpu import AmdCard, discover_cards
from exporter.sources.nvml import NvmlBackend, is_library_missing, is_not_supported
from exporter.sources.pci import number_host_gpus
from exporter.sources.procfs import all_pids
from exporter.sources.sysfs import read_int
from exporter.sources.systemd import SystemdError, show_units, unit_pids
from fleet.gpu_index import GpuIndex, normalize_pci_bus_id
from fleet.roster import PowerBounds, Server

T = TypeVar("T")

DEFAULT_STATE_DIR = Path("/var/lib/gpu-fleet-node")
# NVML calls can hang for tens of seconds when a GPU falls off the bus: every NVML step of a
# verb runs under this deadline and reports it, instead of outliving the caller's timeout.
NVML_DEADLINE_SECONDS = 20.0


class GpuError(Exception):
    """The GPUs could not be read (NVML failing or hanging), or their processes listed."""


@dataclass
class Gpu:
    """One GPU of the host, under the exporter's `gpu` index."""

    index: int
    vendor: str  # "nvidia" or "amd"
    pci_bus_id: str
    handle: object | None = None  # NVML handle (NVIDIA)
    card: AmdCard | None = None  # amdgpu card (AMD)


def _deadline(call: Callable[[], T], seconds: float, what: str) -> T:
    """`call()` in a worker thread, given up after `seconds` (a hung driver call)."""
    box: dict[str, Any] = {}

    def work() -> None:
        try:
            box["value"] = call()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread as it is
            box["error"] = exc

    worker = threading.Thread(target=work, name=f"gpu-fleet-node {what}", daemon=True)
    worker.start()
    worker.join(seconds)
    if worker.is_alive():
        raise GpuError(f"{what}: NVML did not answer within {seconds:g} s (a GPU off the bus?)")
    if "error" in box:
        raise box["error"]
    value: T = box["value"]
    return value


class Gpus:
    """The host's GPUs: enumerated once per command, NVML initialised until `close()`."""

    def __init__(
        self,
        nvml: NvmlBackend,
        *,
        sysfs: str = "/sys",
        expected: Sequence[str] = (),
        deadline_seconds: float = NVML_DEADLINE_SECONDS,
    ) -> None:
        self._nvml = nvml
        self._sysfs = sysfs
        self._expected = tuple(expected)
        self._deadline_seconds = deadline_seconds
        self._initialised = False
        self.gpus: list[Gpu] = []
        self.numbering: dict[str, int] = {}  # PCI bus id -> `gpu`, present or not
        self._enumerate()

    def _call(self, call: Callable[[], T], what: str) -> T:
        return _deadline(call, self._deadline_seconds, what)

    def _enumerate(self) -> None:
        nvidia: dict[str, object] = {}
        try:
            self._call(self._nvml.nvmlInit, "nvmlInit")
            self._initialised = True
        except pynvml.NVMLError as exc:
            if not is_library_missing(exc):
                raise GpuError(f"NVML cannot start: {exc}") from None
        if self._initialised:
            nvidia = self._call(self._nvidia_bus_ids, "enumerating NVIDIA GPUs")
        use_udev = os.path.realpath(self._sysfs) == "/sys"
        amd = {
            location.pci_slot: AmdCard(location)
            for location in discover_cards(self._sysfs, use_udev=use_udev)
        }
        index = GpuIndex()
        self.numbering = number_host_gpus(
            index, sysfs=self._sysfs, expected=self._expected, found=[*nvidia, *amd]
        )
        for bus_id, handle in nvidia.items():
            self.gpus.append(Gpu(index.index_of(bus_id), "nvidia", bus_id, handle=handle))
        for bus_id, card in amd.items():
            self.gpus.append(Gpu(index.index_of(bus_id), "amd", bus_id, card=card))
        self.gpus.sort(key=lambda gpu: gpu.index)

    def _nvidia_bus_ids(self) -> dict[str, object]:
        nvml = self._nvml
        found: dict[str, object] = {}
        try:
            for i in range(nvml.nvmlDeviceGetCount()):
                handle = nvml.nvmlDeviceGetHandleByIndex(i)
                found[normalize_pci_bus_id(nvml.nvmlDeviceGetPciInfo(handle).busId)] = handle
        except pynvml.NVMLError as exc:
            raise GpuError(f"cannot enumerate NVIDIA GPUs: {exc}") from None
        return found

    def close(self) -> None:
        """Release NVML."""
        if self._initialised:
            self._initialised = False
            with contextlib.suppress(pynvml.NVMLError, GpuError):
                self._call(self._nvml.nvmlShutdown, "nvmlShutdown")

    def by_index(self, index: int) -> Gpu | None:
        """The GPU with this `gpu` index, if present."""
        return next((gpu for gpu in self.gpus if gpu.index == index), None)

    def bus_id_of(self, index: int) -> str | None:
        """The PCI bus id this host numbers `index` (a card may be numbered and absent)."""
        return next((bus for bus, i in self.numbering.items() if i == index), None)

    # -- processes ------------------------------------------------------------------------

    def processes(self, procfs: str = "/proc") -> list[tuple[int, int, int | None]]:
        """`(pid, gpu, memory bytes or None)` of every GPU process.

        NVML's compute and MPS processes, and AMD's DRM clients (fdinfo).
        """
        found: list[tuple[int, int, int | None]] = []
        for gpu in self.gpus:
            if gpu.vendor == "nvidia":
                listed = self._call(partial(self._nvidia_processes, gpu.handle), "NVML processes")
                found.extend((pid, gpu.index, used) for pid, used in listed)
        amd = {gpu.pci_bus_id: gpu.index for gpu in self.gpus if gpu.vendor == "amd"}
        if amd:
            pids = all_pids(procfs)
            if pids is None:
                raise GpuError(f"cannot list the processes of {procfs}")
            scan = drm_fdinfo.scan(pids, procfs=procfs)
            for (pid, pdev), used in sorted(scan.vram.items()):
                if pdev in amd:
                    found.append((pid, amd[pdev], used))
        return found

    def _nvidia_processes(self, handle: object) -> list[tuple[int, int | None]]:
        nvml = self._nvml
        result: dict[int, int | None] = {}
        for call in (
            nvml.nvmlDeviceGetComputeRunningProcesses,
            nvml.nvmlDeviceGetMPSComputeRunningProcesses,
        ):
            try:
                entries = call(handle)
            except pynvml.NVMLError as exc:
                if is_not_supported(exc):
                    continue  # no MPS on this GPU, or a driver without the call
                raise GpuError(f"NVML processes: {exc}") from None
            for entry in entries:
                used = entry.usedGpuMemory
                result[int(entry.pid)] = int(used) if isinstance(used, int) else None
        return sorted(result.items())

    # -- power ------------------------------------------------------------------------------

    def power(self, gpu: Gpu) -> tuple[float, float, float]:
        """`(current, device min, device max)` watts of the GPU's power cap."""
        if gpu.vendor == "nvidia":
            return self._call(lambda: self._nvidia_power(gpu.handle), "NVML power limits")
        files = gpu.card.power_cap_files if gpu.card is not None else {}
        values = [
            read_int(files[name]) if name in files else None
            for name in ("power1_cap", "power1_cap_min", "power1_cap_max")
        ]
        if any(value is None for value in values):
            raise Refused(
                f"GPU {gpu.index} (amdgpu {gpu.pci_bus_id}) has no readable power1_cap, "
                "power1_cap_min and power1_cap_max: its power cap cannot be set"
            )
        current, low, high = (float(v or 0) / 1_000_000 for v in values)
        return current, low, high

    def _nvidia_power(self, handle: object) -> tuple[float, float, float]:
        nvml = self._nvml
        try:
            low, high = nvml.nvmlDeviceGetPowerManagementLimitConstraints(handle)
            current = nvml.nvmlDeviceGetEnforcedPowerLimit(handle)
        except pynvml.NVMLError as exc:
            raise Refused(f"NVML cannot read the power limits: {exc}") from None
        return current / 1000, low / 1000, high / 1000

    def set_power(self, gpu: Gpu, watts: float) -> None:
        """Set the GPU's power cap; raises `Failed` when the device refuses it."""
        if gpu.vendor == "nvidia":
            handle = gpu.handle

            def set_limit() -> None:
                try:
                    self._nvml.nvmlDeviceSetPowerManagementLimit(handle, round(watts * 1000))
                except pynvml.NVMLError as exc:
                    raise Failed(f"nvmlDeviceSetPowerManagementLimit: {exc}") from None

            self._call(set_limit, "nvmlDeviceSetPowerManagementLimit")
            return
        path = gpu.card.power_cap_files["power1_cap"] if gpu.card is not None else ""
        try:
            with open(path, "w", encoding="ascii") as f:
                f.write(f"{round(watts * 1_000_000)}\n")
        except OSError as exc:
            raise Failed(f"cannot write {path}: {exc.strerror or exc}") from None


def gpu_processes(
    gpus: Gpus, servers: Mapping[str, Server], procfs: str, sysfs: str
) -> list[dict[str, Any]]:
    """Every GPU process with the roster server whose unit it belongs to (None: no server)."""
    owners: dict[int, str] = {}
    if servers:
        with contextlib.suppress(SystemdError):  # no units: processes are listed unattributed
            statuses = show_units([s.unit for s in servers.values()])
            for name, server in servers.items():
                for pid in unit_pids(statuses[server.unit], sysfs=sysfs, procfs=procfs):
                    owners[pid] = name
    return [
        {"pid": pid, "gpu": gpu, "memory_bytes": used, "server": owners.get(pid)}
        for pid, gpu, used in gpus.processes(procfs)
    ]


# ---------------------------------------------------------------------------------------------
# The verbs
# ---------------------------------------------------------------------------------------------


def _record_path(state_dir: Path, index: int) -> Path:
    return state_dir / f"power-cap-gpu{index}.json"


def _write_atomically(path: Path, data: dict[str, Any]) -> None:
    """Write JSON so that a crash leaves the old file or the new one, never half of one."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=2)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
    directory = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(directory)  # the rename itself survives a crash only once the directory is
    finally:
        os.close(directory)


def _read_record(path: Path) -> dict[str, Any] | None:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise Failed(f"cannot read {path}: {exc.strerror or exc}") from None
    try:
        record = json.loads(text)
    except ValueError:
        raise Failed(f"{path} is not valid JSON: restore the power cap by hand") from None
    if not isinstance(record, dict) or not isinstance(record.get("previous_watts"), int | float):
        raise Failed(f"{path} holds no previous_watts: restore the power cap by hand")
    return record


def _find(gpus: Gpus, index: int, pci_bus_id: str) -> Gpu:
    """The GPU the request names, when this host numbers it as the request does."""
    own = gpus.bus_id_of(index)
    if own is None:
        raise Refused(f"there is no GPU {index} on this host ({len(gpus.gpus)} present)")
    if own != pci_bus_id:
        raise Refused(
            f"GPU {index} is {own} on this host, but the request names {pci_bus_id}: the "
            "numbering differs from the one the request was made with (a card missing or "
            "added since), so nothing was done"
        )
    gpu = gpus.by_index(index)
    if gpu is None:
        raise Refused(f"GPU {index} ({own}) is not present (off the bus, or no driver sees it)")
    return gpu


def power_cap(
    gpus: Gpus,
    index: int,
    pci_bus_id: str,
    watts: int,
    *,
    bounds: PowerBounds,
    state_dir: Path,
) -> dict[str, Any]:
    """`power-cap GPU WATTS PCI_BUS_ID`: the result; `Refused` before any change, `Failed` after."""
    gpu = _find(gpus, index, pci_bus_id)
    current, low, high = gpus.power(gpu)
    if not low <= watts <= high:
        raise Refused(
            f"{watts} W is outside GPU {index}'s own range {low:g}-{high:g} W ({gpu.vendor} "
            f"{gpu.pci_bus_id})"
        )
    path = _record_path(state_dir, index)
    record = _read_record(path)
    if record is not None and record.get("pci_bus_id") != gpu.pci_bus_id:
        raise Refused(
            f"{path} records GPU {index} as {record.get('pci_bus_id')}, but GPU {index} is "
            f"{gpu.pci_bus_id} now: restore by hand and remove the record"
        )
    created = record is None
    if record is None:
        record = {
            "gpu": index,
            "vendor": gpu.vendor,
            "pci_bus_id": gpu.pci_bus_id,
            "previous_watts": current,
            "recorded_at": time.time(),
        }
        try:
            _write_atomically(path, record)
        except OSError as exc:
            raise Failed(
                f"cannot record the previous power cap in {path}: {exc.strerror or exc}; "
                "nothing was changed"
            ) from None
    result = {
        "gpu": index,
        "vendor": gpu.vendor,
        "pci_bus_id": gpu.pci_bus_id,
        "requested_watts": watts,
        "before_watts": current,
        "previous_watts": record["previous_watts"],
        "device_min_watts": low,
        "device_max_watts": high,
        "roster_min_watts": bounds.min,
        "roster_max_watts": bounds.max,
        "record": str(path),
    }
    try:
        gpus.set_power(gpu, watts)
    except Failed as exc:
        if created:  # nothing changed: no record of a change that did not happen
            with contextlib.suppress(OSError):
                path.unlink()
        raise Failed(str(exc), result) from None
    result["current_watts"] = gpus.power(gpu)[0]
    return result


def power_cap_restore(gpus: Gpus, index: int, pci_bus_id: str, state_dir: Path) -> dict[str, Any]:
    """`power-cap-restore GPU PCI_BUS_ID`: set the recorded value back, remove the record."""
    path = _record_path(state_dir, index)
    record = _read_record(path)
    if record is None:
        return {
            "gpu": index,
            "pci_bus_id": pci_bus_id,
            "restored": False,
            "message": f"no power cap of GPU {index} is recorded ({path}): nothing to restore",
        }
    gpu = _find(gpus, index, pci_bus_id)
    if record.get("pci_bus_id") != gpu.pci_bus_id:
        raise Refused(
            f"{path} is for {record.get('pci_bus_id')}, but GPU {index} is {gpu.pci_bus_id} "
            "now: restore by hand and remove the record"
        )
    previous = float(record["previous_watts"])
    current, low, high = gpus.power(gpu)
    result = {
        "gpu": index,
        "vendor": gpu.vendor,
        "pci_bus_id": gpu.pci_bus_id,
        "restored": False,
        "before_watts": current,
        "previous_watts": previous,
        "record": str(path),
    }
    if not low <= previous <= high:
        raise Failed(
            f"the recorded {previous:g} W is outside GPU {index}'s range {low:g}-{high:g} W now",
            result,
        )
    try:
        gpus.set_power(gpu, previous)
    except Failed as exc:
        raise Failed(str(exc), result) from None  # the record stays: a later restore may work
    result["current_watts"] = gpus.power(gpu)[0]
    try:
        path.unlink()
    except OSError as exc:
        raise Failed(f"restored, but cannot remove {path}: {exc.strerror or exc}", result) from None
    result["restored"] = True
    return result
