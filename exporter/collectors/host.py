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

from collections.abc import Callable, Iterator

import psutil
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric

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

        def gauge(name: str, documentation: str, read: Callable[[], float | None]) -> Metric | None:
            try:
                value = read()
            except _PSUTIL_ERRORS as err:
                failed.append(f"{name}: {err}")
                return None
            return None if value is None else GaugeMetricFamily(name, documentation, value=value)

        families: list[Metric | None] = []
        try:
            times = psutil.cpu_times(percpu=False)
        except _PSUTIL_ERRORS as err:
            failed.append(f"cpu times: {err}")
        else:
            cpu = CounterMetricFamily(
                "gpufleet_host_cpu_seconds",
                "CPU time spent in each mode, summed over all CPUs (guest time is in user/nice).",
                labels=["mode"],
            )
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
                families.append(
                    GaugeMetricFamily(
                        f"gpufleet_host_load{minutes}",
                        f"Load average over {minutes} minute(s).",
                        value=value,
                    )
                )
        try:
            memory = psutil.virtual_memory()
        except _PSUTIL_ERRORS as err:
            failed.append(f"memory: {err}")
        else:
            families += (
                GaugeMetricFamily(
                    "gpufleet_host_memory_total_bytes", "Physical memory.", value=memory.total
                ),
                GaugeMetricFamily(
                    "gpufleet_host_memory_available_bytes",
                    "Memory available to new processes without swapping (MemAvailable).",
                    value=memory.available,
                ),
                GaugeMetricFamily(
                    "gpufleet_host_memory_used_bytes", "Memory in use.", value=memory.used
                ),
            )
        try:
            swap = psutil.swap_memory()
        except _PSUTIL_ERRORS as err:
            failed.append(f"swap: {err}")
        else:
            families += (
                GaugeMetricFamily(
                    "gpufleet_host_swap_total_bytes", "Swap space.", value=swap.total
                ),
                GaugeMetricFamily("gpufleet_host_swap_used_bytes", "Swap in use.", value=swap.used),
            )
        families.append(
            gauge(
                "gpufleet_host_cpus",
                "Logical CPUs.",
                lambda: psutil.cpu_count(logical=True),  # None when it cannot be determined
            )
        )
        yield from (family for family in families if family is not None)
        if failed:
            raise CollectorError("; ".join(failed))

    def close(self) -> None:
        """Nothing to release."""
