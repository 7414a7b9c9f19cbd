"""The fake NVML must not drift from the installed pynvml (DESIGN.md, "Tests: real parts").

No GPU runs here, so everything the NVIDIA collector knows about NVML is checked against the
installed `nvidia-ml-py` itself: the function names and parameters the fake spells out, the
structures it returns, the exception classes it raises, and the set of calls the collector
makes (found by parsing its source, so that the fake cannot fall behind the collector).
"""

from __future__ import annotations

import ast
import ctypes
import ctypes.util
import inspect
import re
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pynvml
import pytest

from exporter.collectors.nvidia import NvidiaCollector
from exporter.sources import nvml
from exporter.sources.nvml import NvmlBackend, field_value, handle_key, load_backend, pci_id
from exporter.sources.nvml_fake import FakeNvml, ScenarioError, load_scenario
from fleet.gpu_index import GpuIndex

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures" / "nvml"
CALLERS = [
    ROOT / "exporter" / "collectors" / "nvidia.py",
    ROOT / "exporter" / "sources" / "nvml.py",
    ROOT / "exporter" / "node" / "gpus.py",  # gpu-fleet-node: processes, power capping
]


def nvml_methods(cls: type) -> list[str]:
    return sorted(n for n in vars(cls) if n.startswith("nvml") and callable(getattr(cls, n)))


FAKE_METHODS = nvml_methods(FakeNvml)
PROTOCOL_METHODS = nvml_methods(NvmlBackend)


def parameters(fn: Callable[..., Any], *, bound: bool) -> list[tuple[str, Any, Any]]:
    params = list(inspect.signature(fn).parameters.values())
    if bound:
        params = params[1:]  # self
    return [(p.name, p.kind, p.default) for p in params]


# How the collector spells the backend: `self._nvml.nvmlX`, `collector._nvml.nvmlX`, or a local
# `nvml = self._nvml` / `backend` parameter.
BACKEND_NAMES = {"_nvml", "nvml", "backend"}


def backend_calls(path: Path) -> set[str]:
    """The `nvml*` functions a module takes from the backend, found in its syntax tree."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if not (isinstance(node, ast.Attribute) and node.attr.startswith("nvml")):
            continue
        base = node.value
        base_name = base.id if isinstance(base, ast.Name) else getattr(base, "attr", None)
        if base_name in BACKEND_NAMES:
            names.add(node.attr)
        elif base_name != "pynvml":  # pynvml.nvml* are constants (nvmlMemory_v2, ...)
            # Anything else is a structure field (`field.nvmlReturn`); a pynvml function reached
            # through another name would escape this check, so refuse it.
            assert not callable(getattr(pynvml, node.attr, None)), (
                f"{path.name}:{node.lineno}: {node.attr} reached through {ast.unparse(base)!r}; "
                f"use one of {sorted(BACKEND_NAMES)}"
            )
    return names


@pytest.fixture
def fake(tmp_path: Path) -> Iterator[FakeNvml]:
    scenario = tmp_path / "two_gpus.yaml"
    shutil.copy(FIXTURES / "two_gpus.yaml", scenario)
    backend = FakeNvml(scenario)
    backend.nvmlInit()
    yield backend
    backend.nvmlShutdown()


@pytest.mark.parametrize("name", FAKE_METHODS)
def test_fake_function_has_pynvml_signature(name: str) -> None:
    real = getattr(pynvml, name, None)
    assert callable(real), f"pynvml has no {name}"
    assert parameters(getattr(FakeNvml, name), bound=True) == parameters(real, bound=False)


@pytest.mark.parametrize("name", PROTOCOL_METHODS)
def test_backend_protocol_has_pynvml_signature(name: str) -> None:
    real = getattr(pynvml, name, None)
    assert callable(real), f"pynvml has no {name}"
    assert parameters(getattr(NvmlBackend, name), bound=True) == parameters(real, bound=False)


def test_fake_spells_out_every_parameter() -> None:
    for name in FAKE_METHODS:
        for param in inspect.signature(getattr(FakeNvml, name)).parameters.values():
            assert param.kind not in (param.VAR_POSITIONAL, param.VAR_KEYWORD), (name, param)


def test_fake_device_calls_name_themselves() -> None:
    # `hang: {call: ...}` matches the name a method hands to FakeNvml._device.
    checked = 0
    for name in FAKE_METHODS:
        source = inspect.getsource(getattr(FakeNvml, name))
        for named in re.findall(r'self\._device\(\w+, "(\w+)"\)', source):
            assert named == name
            checked += 1
    assert checked >= 25


def test_fake_has_exactly_the_calls_the_collector_makes() -> None:
    called = set().union(*(backend_calls(path) for path in CALLERS))
    # Not vacuous: the parser must see the collector's calls at all.
    assert {
        "nvmlInit",
        "nvmlShutdown",
        "nvmlDeviceGetPowerUsage",
        "nvmlEventSetWait_v2",
        "nvmlDeviceSetPowerManagementLimit",
    } <= called
    assert called == set(FAKE_METHODS), (
        f"collector calls missing from the fake: {sorted(called - set(FAKE_METHODS))}; "
        f"fake functions nothing calls: {sorted(set(FAKE_METHODS) - called)}"
    )
    assert called == set(PROTOCOL_METHODS)
    assert all(callable(getattr(pynvml, name, None)) for name in called)


def test_fake_returns_pynvml_shapes(fake: FakeNvml) -> None:
    assert fake.nvmlDeviceGetCount() == 2
    handle = fake.nvmlDeviceGetHandleByIndex(0)
    assert isinstance(handle, pynvml.c_nvmlDevice_t)
    info = fake.nvmlDeviceGetPciInfo(handle)
    assert isinstance(info, pynvml.nvmlPciInfo_t)
    assert info.busId == "00000000:41:00.0"  # pynvml decodes char arrays to str
    assert info.pciDeviceId == 0x233510DE
    for text in (
        fake.nvmlDeviceGetName(handle),
        fake.nvmlDeviceGetUUID(handle),
        fake.nvmlDeviceGetVbiosVersion(handle),
    ):
        assert isinstance(text, str)
    assert isinstance(fake.nvmlDeviceGetUtilizationRates(handle), pynvml.c_nvmlUtilization_t)
    v1 = fake.nvmlDeviceGetMemoryInfo(handle)
    assert isinstance(v1, pynvml.c_nvmlMemory_t)
    assert not hasattr(v1, "reserved")
    v2 = fake.nvmlDeviceGetMemoryInfo(handle, pynvml.nvmlMemory_v2)
    assert isinstance(v2, pynvml.c_nvmlMemory_v2_t)
    assert v2.used + v2.reserved + v2.free == v2.total
    assert v1.used == v2.used + v2.reserved  # v1 `used` includes the reservation
    fields = fake.nvmlDeviceGetFieldValues(handle, [pynvml.NVML_FI_DEV_MEMORY_TEMP, 0])
    assert isinstance(fields[0], pynvml.c_nvmlFieldValue_t)
    assert field_value(fields[0]) == 61.0
    assert fields[1].nvmlReturn == pynvml.NVML_ERROR_NOT_SUPPORTED
    assert fake.nvmlDeviceGetPowerManagementLimitConstraints(handle) == [200000, 700000]
    assert fake.nvmlDeviceGetRemappedRows(handle) == (3, 0, 0, 0)
    pages = fake.nvmlDeviceGetRetiredPages(
        handle, pynvml.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS
    )
    assert isinstance(pages, list) and len(pages) == 1 and isinstance(pages[0], int)
    event_set = fake.nvmlEventSetCreate()
    assert isinstance(event_set, pynvml.c_nvmlEventSet_t)
    fake.nvmlDeviceRegisterEvents(handle, pynvml.nvmlEventTypeXidCriticalError, event_set)
    event = fake.nvmlEventSetWait_v2(event_set, 0)
    assert isinstance(event, pynvml.c_nvmlEventData_t)
    assert (event.eventType, event.eventData) == (pynvml.nvmlEventTypeXidCriticalError, 13)
    assert handle_key(event.device) == handle_key(handle)  # a new pointer, the same device
    fake.nvmlEventSetFree(event_set)


def test_fake_fails_with_pynvml_classes(fake: FakeNvml, tmp_path: Path) -> None:
    handle = fake.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        fake.nvmlDeviceGetHandleByIndex(2)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        fake.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU + 7)
    with pytest.raises(pynvml.NVMLError_NotSupported):  # the scenario keeps no volatile counts
        fake.nvmlDeviceGetTotalEccErrors(
            handle, pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, pynvml.NVML_VOLATILE_ECC
        )
    event_set = fake.nvmlEventSetCreate()
    with pytest.raises(pynvml.NVMLError_Timeout):  # nothing registered, nothing delivered
        fake.nvmlEventSetWait_v2(event_set, 1)
    fake.nvmlShutdown()
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        fake.nvmlDeviceGetPowerUsage(handle)
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        fake.nvmlShutdown()
    fake.nvmlInit()
    with pytest.raises(pynvml.NVMLError_InvalidArgument):  # handles do not outlive nvmlShutdown
        fake.nvmlDeviceGetPowerUsage(handle)
    missing = FakeNvml(FIXTURES / "library_missing.yaml")
    with pytest.raises(pynvml.NVMLError_LibraryNotFound):
        missing.nvmlInit()
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        missing.nvmlDeviceGetCount()


@pytest.mark.skipif(
    ctypes.util.find_library("nvidia-ml") is not None, reason="this machine has an NVIDIA driver"
)
def test_real_pynvml_without_driver_fails_like_the_fake() -> None:
    with pytest.raises(pynvml.NVMLError) as real:
        pynvml.nvmlInit()
    with pytest.raises(pynvml.NVMLError) as fake:
        FakeNvml(FIXTURES / "library_missing.yaml").nvmlInit()
    assert type(real.value) is type(fake.value) is pynvml.NVMLError_LibraryNotFound
    # And the collector on the real library stays silent when no NVIDIA GPU is expected.
    collector = NvidiaCollector(load_backend(None), gpu_index=GpuIndex(), expected_count=None)
    try:
        assert list(collector.collect()) == []
    finally:
        collector.close()


def test_load_backend() -> None:
    assert load_backend(None) is pynvml
    assert isinstance(load_backend(FIXTURES / "two_gpus.yaml"), FakeNvml)


@pytest.mark.parametrize(
    ("code", "lost", "not_supported", "reinit", "missing"),
    [
        (pynvml.NVML_ERROR_NOT_SUPPORTED, False, True, False, False),
        (pynvml.NVML_ERROR_GPU_IS_LOST, True, False, False, False),
        (pynvml.NVML_ERROR_RESET_REQUIRED, True, False, False, False),
        (pynvml.NVML_ERROR_UNINITIALIZED, False, False, True, False),
        (pynvml.NVML_ERROR_DRIVER_NOT_LOADED, False, False, True, True),
        (pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH, False, False, True, False),
        (pynvml.NVML_ERROR_LIBRARY_NOT_FOUND, False, False, False, True),
        (pynvml.NVML_ERROR_NO_PERMISSION, False, False, False, False),
        (pynvml.NVML_ERROR_UNKNOWN, False, False, False, False),
    ],
)
def test_error_classification(
    code: int, lost: bool, not_supported: bool, reinit: bool, missing: bool
) -> None:
    err = pynvml.NVMLError(code)
    assert (
        nvml.is_gpu_lost(err),
        nvml.is_not_supported(err),
        nvml.needs_reinit(err),
        nvml.is_library_missing(err),
    ) == (lost, not_supported, reinit, missing)
    assert nvml.error_code(err) == code
    assert nvml.error_code(ValueError("x")) is None


def test_field_value_reads_the_member_named_by_value_type() -> None:
    value = pynvml.c_nvmlFieldValue_t()
    value.nvmlReturn = pynvml.NVML_SUCCESS
    value.valueType = pynvml.NVML_VALUE_TYPE_DOUBLE
    value.value.dVal = 1.5
    assert field_value(value) == 1.5
    value.valueType = pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG
    value.value.ullVal = 2**40
    assert field_value(value) == float(2**40)
    value.nvmlReturn = pynvml.NVML_ERROR_GPU_IS_LOST  # a field fails on its own
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        field_value(value)


def test_handle_key_matches_pointers_to_the_same_device() -> None:
    backing = ctypes.create_string_buffer(1)
    first = ctypes.cast(backing, pynvml.c_nvmlDevice_t)
    second = ctypes.cast(backing, pynvml.c_nvmlDevice_t)
    other = ctypes.cast(ctypes.create_string_buffer(1), pynvml.c_nvmlDevice_t)
    assert first != second  # why handle_key exists
    assert handle_key(first) == handle_key(second) != handle_key(other)


def test_pci_id_unpacks_nvml_device_id() -> None:
    assert pci_id(0x233510DE) == "10de:2335"


def test_clock_event_reason_bits_are_distinct() -> None:
    bits = list(nvml.CLOCKS_EVENT_REASONS.values())
    assert len(set(bits)) == len(bits) and all(bit & (bit - 1) == 0 for bit in bits)


@pytest.mark.parametrize(
    ("text", "complaint"),
    [
        (
            "gpus: [{pci_bus_id: '0000:01:00.0', pci_device_id: 1, fan_speed: 3}]",
            "gpus.0.fan_speed",
        ),
        (
            "gpus: [{pci_bus_id: '0000:01:00.0', pci_device_id: 1, not_supported: [fan]}]",
            "unknown keys ['fan']",
        ),
        (
            "gpus: [{pci_bus_id: '0000:01:00.0', pci_device_id: 1,"
            " hang: {call: nvmlDeviceGetNothing, seconds: 1}}]",
            "gpus.0.hang.call",
        ),
        ("gpus: [{pci_bus_id: 'nope', pci_device_id: 1}]", "gpus.0.pci_bus_id"),
        (
            "gpus: [{pci_bus_id: '0000:01:00.0', pci_device_id: 1},"
            " {pci_bus_id: '00000000:01:00.0', pci_device_id: 1}]",
            "duplicate pci_bus_id",
        ),
    ],
)
def test_bad_scenario_names_the_key(tmp_path: Path, text: str, complaint: str) -> None:
    scenario = tmp_path / "bad.yaml"
    scenario.write_text(text)
    with pytest.raises(ScenarioError) as err:
        FakeNvml(scenario)
    assert str(scenario) in str(err.value)
    assert complaint in str(err.value)


@pytest.mark.parametrize(
    "path",
    [*sorted(FIXTURES.glob("*.yaml")), *sorted((ROOT / "examples" / "nvml-fake").glob("*.yaml"))],
    ids=lambda p: p.name,
)
def test_scenario_files_are_valid(path: Path) -> None:
    scenario = load_scenario(path)
    assert scenario.library_missing or scenario.gpus


def test_fake_power_limit_setter_fails_like_nvml(fake: FakeNvml, tmp_path: Path) -> None:
    handle = fake.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):  # below the constraints' min
        fake.nvmlDeviceSetPowerManagementLimit(handle, 100_000)
    assert fake.nvmlDeviceGetEnforcedPowerLimit(handle) == 650_000
    fake.nvmlDeviceSetPowerManagementLimit(handle, 450_000)
    assert fake.nvmlDeviceGetEnforcedPowerLimit(handle) == 450_000
    # Another user of the same scenario (another process) sees the card's new limit.
    other = FakeNvml(tmp_path / "two_gpus.yaml")
    other.nvmlInit()
    assert other.nvmlDeviceGetEnforcedPowerLimit(other.nvmlDeviceGetHandleByIndex(0)) == 450_000
    other.nvmlShutdown()
    read_only = tmp_path / "read_only.yaml"
    read_only.write_text(
        "gpus:\n  - {pci_bus_id: '0000:01:00.0', pci_device_id: 1, power_limit_read_only: true,"
        " power_limit_milliwatts: {enforced: 300000, min: 100000, max: 400000}}\n"
        "  - {pci_bus_id: '0000:02:00.0', pci_device_id: 1}\n"
    )
    backend = FakeNvml(read_only)
    backend.nvmlInit()
    with pytest.raises(pynvml.NVMLError_NoPermission):  # what a caller without root gets
        backend.nvmlDeviceSetPowerManagementLimit(backend.nvmlDeviceGetHandleByIndex(0), 200_000)
    with pytest.raises(pynvml.NVMLError_NotSupported):  # no power management at all
        backend.nvmlDeviceSetPowerManagementLimit(backend.nvmlDeviceGetHandleByIndex(1), 200_000)
    backend.nvmlShutdown()
