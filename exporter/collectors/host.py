"""Host CPU, load and memory via psutil.

Sample output::

    gpufleet_host_cpu_utilization_ratio 0.12
    gpufleet_host_load1 1.5
    gpufleet_host_memory_available_bytes 1.02e+11
    gpufleet_host_cpus 32.0

Check by hand: `uptime` (load), `free -b` (memory, swap), `nproc --all` (CPUs).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import psutil
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric

from exporter.collectors.base import CollectorError

# psutil raises OSError subclasses for /proc trouble and psutil.Error for its own.
_PSUTIL_ERRORS = (OSError, psutil.Error)


class HostCollector:
    """Collects CPU utilisation since the previous scrape, load averages, memory and swap."""

    name = "host"

    def __init__(self) -> None:
        # cpu_percent(interval=None) measures since its previous call; the first call has
        # nothing to compare with and returns 0.0, so prime it here.
        psutil.cpu_percent(interval=None)

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

        families: list[Metric | None] = [
            gauge(
                "gpufleet_host_cpu_utilization_ratio",
                "Fraction of CPU time busy since the previous scrape, over all CPUs.",
                lambda: psutil.cpu_percent(interval=None) / 100,
            )
        ]
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
