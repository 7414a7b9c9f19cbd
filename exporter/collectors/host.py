"""Host CPU, load and memory from procfs (`/proc/stat`, `/proc/loadavg`, `/proc/meminfo`).

Read under the exporter's `--procfs` root, as every other procfs reader is (psutil reads only
its global `PROCFS_PATH`, which a collector must not change under its neighbours, so an
exporter in a container with the host's /proc mounted elsewhere read the container's).

CPU time is exported as counters, `gpufleet_host_cpu_seconds_total{mode}` (summed over all
CPUs, as /proc/stat's `cpu` line), not as a ratio since the previous scrape: such a ratio
depends on who scraped last (two Prometheus replicas would each see the other's interval).
The utilisation is a recording rule over the counters
(`host:gpufleet_host_cpu_utilization_ratio:rate5m` in rules/gpu-fleet-recording.rules.yml).
Modes are the kernel's, less `guest` and `guest_nice`, which /proc/stat already counts inside
`user` and `nice` (proc(5)): the modes add up to the CPU time that passed. Memory as `free`
and psutil give it: used = total - free - buffers - cached (cached including SReclaimable).

Sample output::

    gpufleet_host_cpu_seconds_total{mode="user"} 123456.78
    gpufleet_host_cpu_seconds_total{mode="idle"} 9876543.21
    gpufleet_host_load1 1.5
    gpufleet_host_memory_available_bytes 1.02e+11
    gpufleet_host_cpus 32.0

Check by hand: `head -1 /proc/stat` (CPU time in clock ticks, USER_HZ), `uptime` (load),
`free -b` (memory, swap), `nproc --all` (CPUs).
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.metrics_core import Metric

from exporter.collectors import catalogue
from exporter.collectors.base import CollectorError
from exporter.sources.procfs import CPU_FIELDS, read_cpu_times, read_loadavg, read_meminfo

CPU_MODES = CPU_FIELDS  # exported as `mode`


class HostCollector:
    """Collects CPU time counters, load averages, memory and swap from `procfs`."""

    name = "host"

    def __init__(self, procfs: str = "/proc") -> None:
        self._procfs = procfs

    def collect(self) -> Iterator[Metric]:
        """Yield the host families; an unreadable file drops only its own series.

        Raises `CollectorError` after yielding when a file could not be read.
        """
        failed: list[str] = []

        def one(name: str, value: float) -> Metric:
            family = catalogue.gauge(name)
            family.add_metric([], value)
            return family

        families: list[Metric] = []
        times = read_cpu_times(self._procfs)
        if times is None:
            failed.append(f"cannot read {self._procfs}/stat")
        else:
            cpu = catalogue.counter("gpufleet_host_cpu_seconds_total")
            for mode, seconds in times.seconds.items():
                cpu.add_metric([mode], seconds)
            families.append(cpu)
        load = read_loadavg(self._procfs)
        if load is None:
            failed.append(f"cannot read {self._procfs}/loadavg")
        else:
            for minutes, value in zip((1, 5, 15), load, strict=True):
                families.append(one(f"gpufleet_host_load{minutes}", value))
        memory = read_meminfo(self._procfs)
        if memory is None:
            failed.append(f"cannot read {self._procfs}/meminfo")
            memory = {}
        total, free = memory.get("MemTotal"), memory.get("MemFree")
        if total is not None:
            families.append(one("gpufleet_host_memory_total_bytes", total))
        if (available := memory.get("MemAvailable")) is not None:
            families.append(one("gpufleet_host_memory_available_bytes", available))
        if total is not None and free is not None:
            cached = memory.get("Cached", 0) + memory.get("SReclaimable", 0)
            used = total - free - memory.get("Buffers", 0) - cached
            used = used if used >= 0 else total - free  # as psutil does
            families.append(one("gpufleet_host_memory_used_bytes", used))
        swap_total, swap_free = memory.get("SwapTotal"), memory.get("SwapFree")
        if swap_total is not None and swap_free is not None:
            families += (
                one("gpufleet_host_swap_total_bytes", swap_total),
                one("gpufleet_host_swap_used_bytes", swap_total - swap_free),
            )
        if times is not None and times.cpus is not None:
            families.append(one("gpufleet_host_cpus", times.cpus))
        yield from families
        if failed:
            raise CollectorError("; ".join(failed))

    def close(self) -> None:
        """Nothing to release."""
