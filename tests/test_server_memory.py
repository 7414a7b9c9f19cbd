"""GPU memory per server: NVML's processes (fake NVML: no GPU here) and AMD DRM fdinfo.

The /proc and cgroup trees are fixtures written in the kernel's formats (fd links to
/dev/dri, fdinfo per Documentation/gpu/drm-usage-stats.rst, cgroup v2 `cgroup.procs`);
systemctl is the stand-in (tests/stand_in_bin/systemctl): systemd is not PID 1 here.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from exporter.collectors.nvidia import NvidiaCollector
from exporter.collectors.server_memory import ServerMemoryCollector
from exporter.gpu_index import GpuIndex
from exporter.roster import Server
from exporter.sources.drm_fdinfo import parse_fdinfo
from exporter.sources.nvml import load_backend
from exporter.sources.systemd import UnitsReader
from tests.scraping import scrape
from tests.systemctl_stand_in import SystemctlStandIn

GIB = 1024**3

SCENARIO = """\
gpus:
  - pci_bus_id: "0000:41:00.0"
    pci_device_id: 0x233510DE
    name: NVIDIA H200
    uuid: GPU-1
    processes:
      - {pid: 100, used_bytes: %(alpha)d}     # alpha's main process
      - {pid: 999, used_bytes: 536870912}     # the MPS server: nobody's
    mps_processes:
      - {pid: 201, used_bytes: 3221225472}    # a child of beta's main process (an MPS client)
      - {pid: 555, used_bytes: null}          # NVML cannot say: not counted
"""


def server(unit: str, gpu: int | None = None) -> Server:
    return Server.model_validate(
        {
            "engine": "llama",
            "url": f"http://127.0.0.1:{31000 + len(unit)}",
            "unit": unit,
            "role": "gpu-dense",
            "model": "m",
            **({"gpu": gpu} if gpu is not None else {}),
        }
    )


def write_drm_fd(procfs: Path, pid: int, fd: int, pdev: str, *, client: int, vram_kib: int) -> None:
    fd_dir, info_dir = procfs / str(pid) / "fd", procfs / str(pid) / "fdinfo"
    fd_dir.mkdir(parents=True, exist_ok=True)
    info_dir.mkdir(parents=True, exist_ok=True)
    os.symlink("/dev/dri/renderD128", fd_dir / str(fd))
    (info_dir / str(fd)).write_text(
        f"pos:\t0\nflags:\t02100002\nmnt_id:\t24\nino:\t1086\ndrm-driver:\tamdgpu\n"
        f"drm-client-id:\t{client}\ndrm-pdev:\t{pdev}\ndrm-memory-vram:\t{vram_kib} KiB\n"
        f"drm-memory-gtt:\t2048 KiB\ndrm-memory-cpu:\t0 KiB\n"
    )


def write_other_fd(procfs: Path, pid: int, fd: int, target: str) -> None:
    (procfs / str(pid) / "fd").mkdir(parents=True, exist_ok=True)
    os.symlink(target, procfs / str(pid) / "fd" / str(fd))


def write_stat(procfs: Path, pid: int, ppid: int) -> None:
    (procfs / str(pid)).mkdir(parents=True, exist_ok=True)
    (procfs / str(pid) / "stat").write_text(f"{pid} (llama server) S {ppid} {pid} {pid} 0 -1\n")


@pytest.fixture
def host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, object]]:
    procfs, sysfs = tmp_path / "proc", tmp_path / "sys"
    procfs.mkdir()
    # alpha: its unit's cgroup lists pids 100 and 101 (a worker it forked).
    cgroup = sysfs / "fs" / "cgroup" / "system.slice" / "llama-server@alpha.service"
    cgroup.mkdir(parents=True)
    (cgroup / "cgroup.procs").write_text("100\n101\n")
    # beta: no readable cgroup; main pid 200 with child 201 (found through /proc/PID/stat).
    write_stat(procfs, 200, 1)
    write_stat(procfs, 201, 200)
    write_stat(procfs, 300, 1)
    # AMD iGPU at 0000:c5:00.0: alpha's 100 and its child 101 share one DRM client (counted
    # once); 300 belongs to nobody; an unrelated fd and a non-amdgpu DRM file are ignored.
    write_drm_fd(procfs, 100, 5, "0000:c5:00.0", client=7, vram_kib=4 * 1024 * 1024)
    write_drm_fd(procfs, 101, 5, "0000:c5:00.0", client=7, vram_kib=4 * 1024 * 1024)
    write_drm_fd(procfs, 300, 9, "0000:c5:00.0", client=9, vram_kib=1024 * 1024)
    write_other_fd(procfs, 300, 1, "/dev/null")
    stand_in = SystemctlStandIn(tmp_path)
    stand_in.activate(monkeypatch)
    stand_in.set_unit(
        "llama-server@alpha.service",
        ActiveState="active",
        MainPID=100,
        ControlGroup="/system.slice/llama-server@alpha.service",
    )
    stand_in.set_unit("llama-server@beta.service", ActiveState="active", MainPID=200)
    stand_in.set_unit("llama-server@gamma.service", ActiveState="active", MainPID=0)
    scenario = tmp_path / "nvml.yaml"
    scenario.write_text(SCENARIO % {"alpha": 20 * GIB})
    yield {"procfs": procfs, "sysfs": sysfs, "stand_in": stand_in, "scenario": scenario}


def collectors(host: dict[str, object]) -> tuple[NvidiaCollector, ServerMemoryCollector]:
    servers = {
        "alpha": server("llama-server@alpha.service"),
        "beta": server("llama-server@beta.service"),
        "gamma": server("llama-server@gamma.service", gpu=1),
    }
    index = GpuIndex()
    index.register(["0000:41:00.0", "0000:c5:00.0"])
    scenario = host["scenario"]
    assert isinstance(scenario, Path)
    nvidia = NvidiaCollector(load_backend(scenario), gpu_index=index, expected_count=1)
    units = UnitsReader([s.unit for s in servers.values()])
    memory = ServerMemoryCollector(
        servers,
        units,
        nvidia=nvidia,
        amd_bus_ids=lambda: ["0000:c5:00.0"],
        gpu_index=index,
        procfs=str(host["procfs"]),
        sysfs=str(host["sysfs"]),
    )
    return nvidia, memory


def test_memory_is_attributed_to_servers_by_unit(host: dict[str, object]) -> None:
    nvidia, memory = collectors(host)
    try:
        scrape(nvidia)  # the memory collector reads what this scrape of NVML found
        registry, error = scrape(memory)
    finally:
        nvidia.close()
    assert error is None
    value = registry.get_sample_value
    assert value("gpufleet_server_gpu_memory_bytes", {"server": "alpha", "gpu": "0"}) == 20 * GIB
    assert value("gpufleet_server_gpu_memory_bytes", {"server": "beta", "gpu": "0"}) == 3 * GIB
    assert value("gpufleet_gpu_unowned_memory_bytes", {"gpu": "0"}) == 0.5 * GIB
    # AMD: one shared client counted once for alpha; pid 300 is nobody's.
    assert value("gpufleet_server_gpu_memory_bytes", {"server": "alpha", "gpu": "1"}) == 4 * GIB
    assert value("gpufleet_gpu_unowned_memory_bytes", {"gpu": "1"}) == 1 * GIB
    # gamma's unit is active, its roster GPU is 1, it holds nothing there: 0, not silence.
    assert value("gpufleet_server_gpu_memory_bytes", {"server": "gamma", "gpu": "1"}) == 0
    assert value("gpufleet_server_gpu_memory_bytes", {"server": "beta", "gpu": "1"}) is None


def test_a_changed_process_list_shows_on_the_next_scrape(host: dict[str, object]) -> None:
    nvidia, memory = collectors(host)
    scenario = host["scenario"]
    assert isinstance(scenario, Path)
    try:
        scrape(nvidia)
        first, _ = scrape(memory)
        scenario.write_text(SCENARIO % {"alpha": 22 * GIB})
        os.utime(scenario, (1, 2))  # a different mtime even within the same second
        scrape(nvidia)
        second, _ = scrape(memory)
    finally:
        nvidia.close()
    labels = {"server": "alpha", "gpu": "0"}
    assert first.get_sample_value("gpufleet_server_gpu_memory_bytes", labels) == 20 * GIB
    assert second.get_sample_value("gpufleet_server_gpu_memory_bytes", labels) == 22 * GIB


def test_without_systemd_nothing_is_attributed(host: dict[str, object]) -> None:
    stand_in = host["stand_in"]
    assert isinstance(stand_in, SystemctlStandIn)
    stand_in.fail = {"exit": 1, "stderr": "Failed to connect to bus: No such file or directory"}
    stand_in.save()
    nvidia, memory = collectors(host)
    try:
        scrape(nvidia)
        registry, error = scrape(memory)
    finally:
        nvidia.close()
    assert error is not None and "Failed to connect to bus" in str(error)
    assert registry.get_sample_value("gpufleet_gpu_unowned_memory_bytes", {"gpu": "0"}) is None


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("drm-driver:\tamdgpu\ndrm-pdev:\t0000:03:00.0\ndrm-client-id:\t3\n"
         "drm-memory-vram:\t1024 KiB\n", ("0000:03:00.0", "3", 1024 * 1024)),
        ("drm-driver:\tamdgpu\ndrm-pdev:\t0000:03:00.0\ndrm-client-id:\t3\n"
         "drm-total-vram:\t2 MiB\n", ("0000:03:00.0", "3", 2 * 1024 * 1024)),
        ("drm-driver:\ti915\ndrm-pdev:\t0000:00:02.0\ndrm-memory-vram:\t1 KiB\n", None),
        ("pos:\t0\nflags:\t02\n", None),
        ("drm-driver:\tamdgpu\ndrm-pdev:\t0000:03:00.0\ndrm-memory-vram:\tlots KiB\n", None),
    ],
)  # fmt: skip
def test_fdinfo_formats(text: str, expected: tuple[str, str, int] | None) -> None:
    assert parse_fdinfo(text) == expected
