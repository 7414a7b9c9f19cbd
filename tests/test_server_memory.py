"""GPU memory per server: NVML's processes (fake NVML: no GPU here) and AMD DRM fdinfo.

The /proc and cgroup trees are fixtures written in the kernel's formats (fd links to
/dev/dri, fdinfo per Documentation/gpu/drm-usage-stats.rst, cgroup v2 `cgroup.procs`);
systemctl is the stand-in (tests/stand_in_bin/systemctl): systemd is not PID 1 here.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from exporter.collectors.base import CollectorError
from exporter.collectors.nvidia import NvidiaCollector
from exporter.collectors.server_memory import ServerMemoryCollector
from exporter.sources.drm_fdinfo import parse_fdinfo
from exporter.sources.nvml import load_backend
from exporter.sources.systemd import UnitsReader
from fleet.gpu_index import GpuIndex
from fleet.roster import Server
from tests.scraping import scrape
from tests.systemctl_stand_in import SystemctlStandIn

GIB = 1024**3
REPO = Path(__file__).resolve().parent.parent

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
%(extra)s"""


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
    scenario.write_text(SCENARIO % {"alpha": 20 * GIB, "extra": ""})
    yield {"procfs": procfs, "sysfs": sysfs, "stand_in": stand_in, "scenario": scenario}


def collectors(
    host: dict[str, object], **kwargs: Any
) -> tuple[NvidiaCollector, ServerMemoryCollector]:
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
        **kwargs,
    )
    return nvidia, memory


def scrape_both(host: dict[str, object], **kwargs: Any) -> tuple[Any, CollectorError | None]:
    """One scrape of NVML, then of the memory collector, which reads what NVML found."""
    nvidia, memory = collectors(host, **kwargs)
    try:
        scrape(nvidia)
        return scrape(memory)
    finally:
        nvidia.close()


def test_memory_is_attributed_to_servers_by_unit(host: dict[str, object]) -> None:
    registry, error = scrape_both(host)
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
        scenario.write_text(SCENARIO % {"alpha": 22 * GIB, "extra": ""})
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
    registry, error = scrape_both(host)
    assert error is not None and "Failed to connect to bus" in str(error)
    assert registry.get_sample_value("gpufleet_gpu_unowned_memory_bytes", {"gpu": "0"}) is None


def test_an_unlistable_proc_leaves_unowned_amd_memory_unknown(host: dict[str, object]) -> None:
    """Which processes exist is unknown: no AMD unowned series, never a 0 from an empty walk."""
    procfs = host["procfs"]
    assert isinstance(procfs, Path)
    procfs.rename(procfs.with_name("proc-elsewhere"))
    registry, error = scrape_both(host)
    assert error is not None and f"cannot list the processes of {procfs}" in str(error)
    assert registry.get_sample_value("gpufleet_gpu_unowned_memory_bytes", {"gpu": "1"}) is None


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


@pytest.mark.parametrize("refusal", ["no_permission", "not_supported"])
def test_a_process_list_nvml_refuses_is_unknown_not_zero(
    host: dict[str, object], refusal: str
) -> None:
    """NO_PERMISSION / NOT_SUPPORTED: neither per-server nor unowned memory for that GPU."""
    scenario = host["scenario"]
    assert isinstance(scenario, Path)
    scenario.write_text(SCENARIO % {"alpha": 20 * GIB, "extra": f"    {refusal}: [processes]\n"})
    registry, error = scrape_both(host)
    value = registry.get_sample_value
    assert value("gpufleet_server_gpu_memory_bytes", {"server": "alpha", "gpu": "0"}) is None
    assert value("gpufleet_server_gpu_memory_bytes", {"server": "beta", "gpu": "0"}) is None
    assert value("gpufleet_gpu_unowned_memory_bytes", {"gpu": "0"}) is None
    assert error is not None and "GPU 0 (0000:41:00.0): NVML cannot list its processes" in str(
        error
    )
    assert "nvmlDeviceGetComputeRunningProcesses" in str(error)
    # The AMD GPU beside it is unaffected.
    assert value("gpufleet_server_gpu_memory_bytes", {"server": "alpha", "gpu": "1"}) == 4 * GIB
    assert value("gpufleet_gpu_unowned_memory_bytes", {"gpu": "1"}) == 1 * GIB


def test_a_refused_mps_list_is_unknown_too(host: dict[str, object]) -> None:
    scenario = host["scenario"]
    assert isinstance(scenario, Path)
    scenario.write_text(
        SCENARIO % {"alpha": 20 * GIB, "extra": "    no_permission: [mps_processes]\n"}
    )
    registry, error = scrape_both(host)
    assert registry.get_sample_value("gpufleet_gpu_unowned_memory_bytes", {"gpu": "0"}) is None
    assert error is not None and "nvmlDeviceGetMPSComputeRunningProcesses" in str(error)


def test_no_mps_list_before_volta_is_not_a_gap(host: dict[str, object]) -> None:
    """NVML answers NOT_SUPPORTED for MPS clients on every pre-Volta GPU: nothing is missing."""
    scenario = host["scenario"]
    assert isinstance(scenario, Path)
    scenario.write_text(
        SCENARIO % {"alpha": 20 * GIB, "extra": "    not_supported: [mps_processes]\n"}
    )
    registry, error = scrape_both(host)
    assert error is None
    value = registry.get_sample_value
    assert value("gpufleet_server_gpu_memory_bytes", {"server": "alpha", "gpu": "0"}) == 20 * GIB
    assert value("gpufleet_server_gpu_memory_bytes", {"server": "beta", "gpu": "0"}) is None
    assert value("gpufleet_gpu_unowned_memory_bytes", {"gpu": "0"}) == 0.5 * GIB


def test_a_process_without_a_figure_leaves_its_owner_unknown(host: dict[str, object]) -> None:
    """`usedGpuMemory` None (MIG, vGPU): the server (or unowned) it belongs to is unknown."""
    scenario = host["scenario"]
    assert isinstance(scenario, Path)
    scenario.write_text(
        SCENARIO
        % {
            "alpha": 20 * GIB,
            # 200 is beta's main process; 555 belongs to nobody.
            "extra": "      - {pid: 200, used_bytes: null}\n      - {pid: 555, used_bytes: null}\n",
        }
    )
    registry, error = scrape_both(host)
    value = registry.get_sample_value
    assert value("gpufleet_server_gpu_memory_bytes", {"server": "alpha", "gpu": "0"}) == 20 * GIB
    assert value("gpufleet_server_gpu_memory_bytes", {"server": "beta", "gpu": "0"}) is None
    assert value("gpufleet_gpu_unowned_memory_bytes", {"gpu": "0"}) is None
    assert error is not None and "no memory figure for 2 process(es)" in str(error)


def test_a_gpu_not_read_this_scrape_has_no_memory_series(host: dict[str, object]) -> None:
    nvidia, memory = collectors(host)
    try:
        # The memory collector runs before any NVML scrape: nothing is known of GPU 0.
        registry, error = scrape(memory)
    finally:
        nvidia.close()
    assert error is None
    assert registry.get_sample_value("gpufleet_gpu_unowned_memory_bytes", {"gpu": "0"}) is None
    assert registry.get_sample_value("gpufleet_gpu_unowned_memory_bytes", {"gpu": "1"}) == GIB


def test_unowned_amd_memory_is_read_under_a_budget_across_scrapes(
    host: dict[str, object],
) -> None:
    """The units' processes every scrape; the rest of /proc a little per scrape."""
    procfs = host["procfs"]
    assert isinstance(procfs, Path)
    for pid in range(400, 420):  # other processes, one of them with 2 GiB on the iGPU
        write_other_fd(procfs, pid, 1, "/dev/null")
    write_drm_fd(procfs, 410, 4, "0000:c5:00.0", client=40, vram_kib=2 * 1024 * 1024)

    class Clock:
        """Each reading moves 1 ms: a budget of 2.5 ms reads about three processes."""

        now = 0.0

        def __call__(self) -> float:
            self.now += 0.001
            return self.now

    nvidia, memory = collectors(host, unowned_budget_seconds=0.0025, clock=Clock())
    try:
        scrape(nvidia)
        results = [scrape(memory) for _ in range(12)]
    finally:
        nvidia.close()
    alpha = [
        r.get_sample_value("gpufleet_server_gpu_memory_bytes", {"server": "alpha", "gpu": "1"})
        for r, _ in results
    ]
    unowned = [
        r.get_sample_value("gpufleet_gpu_unowned_memory_bytes", {"gpu": "1"}) for r, _ in results
    ]
    assert all(error is None for _, error in results)
    assert alpha == [4 * GIB] * 12  # the unit's own processes: every scrape
    # Absent until the first walk of /proc ends (23 processes, about 3 a scrape), then the
    # walk's figure: pid 300 and pid 410.
    first = unowned.index(3 * GIB)
    assert 5 <= first <= 10
    assert unowned[:first] == [None] * first
    assert unowned[first:] == [3 * GIB] * (12 - first)


UNPRIVILEGED_SCRAPE = """
import json, os, sys
from exporter.collectors.server_memory import ServerMemoryCollector
from fleet.gpu_index import GpuIndex
from fleet.roster import Server
from exporter.sources.systemd import UnitsReader
from tests.scraping import scrape

procfs, sysfs = sys.argv[1], sys.argv[2]
servers = {
    name: Server.model_validate({"engine": "llama", "url": f"http://127.0.0.1:{port}",
                                 "unit": f"llama-server@{name}.service", "role": "r", "model": "m"})
    for name, port in (("alpha", 31001), ("beta", 31002))
}
index = GpuIndex()
index.register(["0000:c5:00.0"])

class NoNvidia:
    def process_memory(self):
        return {}

units = UnitsReader([s.unit for s in servers.values()], max_age_seconds=60)
units.statuses()  # systemctl (the stand-in) answers now; the scrape below reuses the answer
memory = ServerMemoryCollector(servers, units, nvidia=NoNvidia(),
    amd_bus_ids=lambda: ["0000:c5:00.0"], gpu_index=index, procfs=procfs, sysfs=sysfs,
    unowned_budget_seconds=None)
import codecs
codecs.lookup("ascii")  # codecs load lazily, from where nobody may not read
if os.geteuid() == 0:
    # As root the kernel would let us read every fd directory whatever its mode: read as
    # nobody, as an exporter without CAP_SYS_PTRACE and CAP_DAC_READ_SEARCH does.
    os.setgid(65534)
    os.setuid(65534)
registry, error = scrape(memory)
samples = [(s.name, s.labels, s.value) for m in registry.collect() for s in m.samples]
print(json.dumps({"samples": samples, "error": None if error is None else str(error)}))
"""


def scrape_as_nobody(base: Path) -> dict[str, Any]:
    """One scrape by a process that may not read root's 0500 fd directories."""
    command = [sys.executable, "-c", UNPRIVILEGED_SCRAPE, str(base / "proc"), str(base / "sys")]
    done = subprocess.run(
        command, capture_output=True, text=True, check=False, cwd=REPO, timeout=60
    )
    assert done.returncode == 0, done.stderr
    result: dict[str, Any] = json.loads(done.stdout)
    return result


@pytest.fixture
def open_tree(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A tree that another user can read (pytest's tmp_path is private to root)."""
    base = Path(tempfile.mkdtemp(prefix="gpufleet-memory-"))
    base.chmod(0o755)
    stand_in = SystemctlStandIn(base)
    stand_in.activate(monkeypatch)
    stand_in.set_unit("llama-server@alpha.service", ActiveState="active", MainPID=100)
    stand_in.set_unit("llama-server@beta.service", ActiveState="active", MainPID=200)
    procfs = base / "proc"
    write_stat(procfs, 100, 1)
    write_stat(procfs, 200, 1)
    write_stat(procfs, 300, 1)
    write_drm_fd(procfs, 100, 5, "0000:c5:00.0", client=7, vram_kib=4 * 1024 * 1024)
    write_drm_fd(procfs, 200, 5, "0000:c5:00.0", client=8, vram_kib=1024 * 1024)
    write_drm_fd(procfs, 300, 9, "0000:c5:00.0", client=9, vram_kib=1024 * 1024)
    (base / "sys").mkdir()
    try:
        yield base
    finally:
        shutil.rmtree(base)


def test_amd_memory_of_a_hidden_unit_process_is_unknown(open_tree: Path) -> None:
    """A unit's process whose fds may not be read: its server has no series, not a 0."""
    (open_tree / "proc" / "200" / "fd").chmod(0o500)  # beta's, owned by root
    result = scrape_as_nobody(open_tree)
    samples = {(name, labels.get("server", "")): value for name, labels, value in result["samples"]}
    assert samples[("gpufleet_server_gpu_memory_bytes", "alpha")] == 4 * GIB
    assert ("gpufleet_server_gpu_memory_bytes", "beta") not in samples
    assert samples[("gpufleet_gpu_unowned_memory_bytes", "")] == 1 * GIB
    assert "1 process(es) of roster units (e.g. pid 200)" in result["error"]


def test_amd_unowned_memory_beside_a_hidden_process_is_unknown(open_tree: Path) -> None:
    """A process of nobody whose fds may not be read: no unowned series, not a 0 next to it."""
    (open_tree / "proc" / "300" / "fd").chmod(0o500)
    result = scrape_as_nobody(open_tree)
    names = {(name, labels.get("server", "")) for name, labels, _ in result["samples"]}
    assert ("gpufleet_server_gpu_memory_bytes", "alpha") in names
    assert ("gpufleet_server_gpu_memory_bytes", "beta") in names
    assert ("gpufleet_gpu_unowned_memory_bytes", "") not in names
    assert "1 other process(es) (e.g. pid 300)" in result["error"]
    assert "CAP_SYS_PTRACE" in result["error"]
