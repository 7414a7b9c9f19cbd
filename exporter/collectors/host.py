"""Host CPU, load and memory via psutil.

CPU time is exported as counters, `gpufleet_host_cpu_seconds_total{mode}` (summed over all
CPUs, as /proc/stat's `cpu` line), not as a ratio since the previous scrape: such a ratio
depends on who scraped last (two Prometheus replicas would each see the other's interval).
The utilisation is a recording rule over the counters
(`host:gpufleet_host_cpu_utilization_ratio:rate5m` in rules/gpu-fleet-recording.rules.yml).
Modes are the kernel's, less `guest` and `guest_nice`, which /proc/stat already counts inside
`user` and `nice` (proc(5)): the modes add up to the CPU time that passed.

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

import psutil
from prometheus_client.metrics_core import Metric

from exporter.collectors import catalogue
from exporter.collectors.base import CollectorError

# psutil raises OSError subclasses for /proc trouble and psutil.Error for its own.
_PSUTIL_ERRORS = (OSError, psutil.Error)
# psutil's cpu_times() fields (Linux) exported as `mode`; guest and guest_nice are left out
# because the kernel already counts them in user and nice.
CPU_MODES = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")


class HostCollector:
    """Collects CPU time counters, load averages, memory and swap."""

    name = "host"

    def collect(self) -> Iterator[Metric]:
        """Yield the host families; a failed psutil call drops only its own series.

        Raises `CollectorError` after yielding when a call failed.
        """
        failed: list[str] = []

        def one(name: str, value: float) -> Metric:
            family = catalogue.gauge(name)
            family.add_metric([], value)
            return family

        families: list[Metric] = []
        try:
            times = psutil.cpu_times(percpu=False)
        except _PSUTIL_ERRORS as err:
            failed.append(f"cpu times: {err}")
        else:
            cpu = catalogue.counter("gpufleet_host_cpu_seconds_total")
            for mode in CPU_MODES:
                value = getattr(times, mode, None)  # a field the kernel lacks: left out
                if isinstance(value, float):
                    cpu.add_metric([mode], value)
            families.append(cpu)
        try:
            load = psutil.getloadavg()
        except _PSUTIL_ERRORS as err:
            failed.append(f"load: {err}")
        else:
            for minutes, value in zip((1, 5, 15), load, strict=True):
                families.append(one(f"gpufleet_host_load{minutes}", value))
        try:
            memory = psutil.virtual_memory()
        except _PSUTIL_ERRORS as err:
            failed.append(f"memory: {err}")
        else:
            families += (
                one("gpufleet_host_memory_total_bytes", memory.total),
                one("gpufleet_host_memory_available_bytes", memory.available),
                one("gpufleet_host_memory_used_bytes", memory.used),
            )
        try:
            swap = psutil.swap_memory()
        except _PSUTIL_ERRORS as err:
            failed.append(f"swap: {err}")
        else:
            families += (
                one("gpufleet_host_swap_total_bytes", swap.total),
                one("gpufleet_host_swap_used_bytes", swap.used),
            )
        try:
            cpus = psutil.cpu_count(logical=True)  # None when it cannot be determined
        except _PSUTIL_ERRORS as err:
            failed.append(f"gpufleet_host_cpus: {err}")
        else:
            if cpus is not None:
                families.append(one("gpufleet_host_cpus", cpus))
        yield from families
        if failed:
            raise CollectorError("; ".join(failed))

    def close(self) -> None:
        """Nothing to release."""
