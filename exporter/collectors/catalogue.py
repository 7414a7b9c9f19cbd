"""The one catalogue of the exporter's metric families: name, type, help, labels and unit.

Every collector makes its families here (`gauge(NAME)`, `counter(NAME)`, `histogram(NAME)`),
so a family has one help text and one label set whichever collector emits it (NVIDIA and AMD
both emit `gpufleet_gpu_*`; before, the first collector's help text won), and the README's
metric table is checked against this list (tests/test_full_scrape.py): a family that is
added, renamed or relabelled here and not there fails the tests.

Names are as exposed: counters end in `_total` (prometheus_client's CounterMetricFamily takes
the name with or without it and writes `_total` on the sample). Labels are in the order the
collectors pass values. The unit is the base unit the name ends with (DESIGN.md, "Names").

Check by hand: `gpu-fleet-exporter --once | grep '^# HELP'`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

GAUGE = "gauge"
COUNTER = "counter"
HISTOGRAM = "histogram"
# Base units a name may end with (before `_total`), as Prometheus' naming guide lists them.
UNITS = ("bytes", "celsius", "watts", "joules", "hertz", "seconds", "ratio", "rpm")


@dataclass(frozen=True, slots=True)
class Family:
    """One metric family of the exporter."""

    name: str
    type: str  # GAUGE, COUNTER or HISTOGRAM
    help: str
    labels: tuple[str, ...]

    @property
    def unit(self) -> str:
        """The base unit the name ends with (`bytes`, `celsius`...); "" for a plain number."""
        base = self.name.removesuffix("_total")
        return next((unit for unit in UNITS if base.endswith(f"_{unit}")), "")


_FAMILIES: tuple[Family, ...] = (
    # GPUs: collectors/nvidia.py, collectors/amd.py
    Family(
        "gpufleet_gpu_info",
        GAUGE,
        "GPU identity; the value is 1. pci_bus_id in sysfs form; card is amdgpu's DRM card (empty "
        "for NVIDIA).",
        ("gpu", "uuid", "pci_bus_id", "vendor", "model", "pci_id", "card", "vbios"),
    ),
    Family(
        "gpufleet_gpu_up",
        GAUGE,
        "1 when the GPU was read, 0 when read and lost or erroring; absent when not read.",
        ("gpu",),
    ),
    Family(
        "gpufleet_gpu_read_timeout",
        GAUGE,
        "1 when reading the GPU did not finish within the collector's deadline (its call hangs), 0"
        " when it was read this scrape; absent when it was not reached.",
        ("gpu",),
    ),
    Family(
        "gpufleet_gpu_compute_mode_expected",
        GAUGE,
        "1 for the compute mode the roster expects.",
        ("gpu", "mode"),
    ),
    Family(
        "gpufleet_gpu_xid_errors_total",
        COUNTER,
        "Xid errors reported by the driver.",
        ("gpu", "xid"),
    ),
    Family("gpufleet_gpus_expected", GAUGE, "GPUs the roster expects, by vendor.", ("vendor",)),
    Family(
        "gpufleet_gpus_lost",
        GAUGE,
        "Expected GPUs that are missing or down (GPUs not read this scrape excluded).",
        ("vendor",),
    ),
    Family(
        "gpufleet_gpu_utilization_ratio",
        GAUGE,
        "Share of the last sample period the GPU was busy, 0-1 (NVML utilization, amdgpu "
        "gpu_busy_percent).",
        ("gpu",),
    ),
    Family(
        "gpufleet_gpu_memory_utilization_ratio",
        GAUGE,
        "Share of the last sample period the GPU memory was accessed, 0-1 (NVML; amdgpu "
        "mem_busy_percent).",
        ("gpu",),
    ),
    Family(
        "gpufleet_gpu_memory_used_bytes",
        GAUGE,
        "GPU memory in use, by pool: vram, vis_vram, gtt (AMD); vram allocated and reserved by the"
        " driver (NVIDIA).",
        ("gpu", "pool"),
    ),
    Family("gpufleet_gpu_memory_total_bytes", GAUGE, "GPU memory size, by pool.", ("gpu", "pool")),
    Family(
        "gpufleet_gpu_temperature_celsius",
        GAUGE,
        "GPU temperature, by sensor (NVIDIA gpu, memory; AMD edge, junction, mem).",
        ("gpu", "sensor"),
    ),
    Family(
        "gpufleet_gpu_temperature_critical_celsius",
        GAUGE,
        "The hardware's critical temperature (NVML shutdown threshold, memory max; amdgpu "
        "temp*_crit).",
        ("gpu", "sensor"),
    ),
    Family(
        "gpufleet_gpu_temperature_slowdown_celsius",
        GAUGE,
        "Temperature at which the hardware slows its clocks (NVML slowdown threshold).",
        ("gpu", "sensor"),
    ),
    Family("gpufleet_gpu_power_watts", GAUGE, "GPU power draw.", ("gpu",)),
    Family(
        "gpufleet_gpu_power_limit_watts",
        GAUGE,
        "GPU power limits: current (enforced; amdgpu power1_cap), default, min, max.",
        ("gpu", "kind"),
    ),
    Family(
        "gpufleet_gpu_energy_joules_total",
        COUNTER,
        "GPU energy used since the driver loaded.",
        ("gpu",),
    ),
    Family("gpufleet_gpu_fan_speed_ratio", GAUGE, "Intended fan speed, 0-1 (NVIDIA).", ("gpu",)),
    Family(
        "gpufleet_gpu_clock_hertz", GAUGE, "Current clock frequency, by clock.", ("gpu", "clock")
    ),
    Family(
        "gpufleet_gpu_clock_max_hertz",
        GAUGE,
        "Highest clock frequency, by clock.",
        ("gpu", "clock"),
    ),
    Family(
        "gpufleet_gpu_throttle_active",
        GAUGE,
        "1 while the clock-event (throttle) reason holds clocks down.",
        ("gpu", "reason"),
    ),
    Family("gpufleet_gpu_pcie_link_generation", GAUGE, "Current PCIe link generation.", ("gpu",)),
    Family("gpufleet_gpu_pcie_link_width", GAUGE, "Current PCIe link width (lanes).", ("gpu",)),
    Family("gpufleet_gpu_pcie_replay_errors_total", COUNTER, "PCIe replays.", ("gpu",)),
    Family(
        "gpufleet_gpu_ecc_errors_total",
        COUNTER,
        "ECC errors, lifetime (aggregate).",
        ("gpu", "kind"),
    ),
    Family(
        "gpufleet_gpu_retired_pages", GAUGE, "Retired memory pages, by cause.", ("gpu", "cause")
    ),
    Family(
        "gpufleet_gpu_retired_pages_pending",
        GAUGE,
        "1 when a page retirement waits for the next driver reload.",
        ("gpu",),
    ),
    Family("gpufleet_gpu_remapped_rows", GAUGE, "Remapped memory rows, by kind.", ("gpu", "kind")),
    Family(
        "gpufleet_gpu_remapped_rows_pending",
        GAUGE,
        "1 when a row remapping waits for a GPU reset.",
        ("gpu",),
    ),
    Family(
        "gpufleet_gpu_remapped_rows_failed",
        GAUGE,
        "1 when a row remapping failed (the GPU needs service).",
        ("gpu",),
    ),
    Family(
        "gpufleet_gpu_compute_mode", GAUGE, "1 for the GPU's NVML compute mode.", ("gpu", "mode")
    ),
    Family(
        "gpufleet_gpu_temperature_emergency_celsius",
        GAUGE,
        "The GPU's emergency (shutdown) temperature (amdgpu temp*_emergency).",
        ("gpu", "sensor"),
    ),
    Family("gpufleet_gpu_fan_speed_rpm", GAUGE, "Fan speed (AMD).", ("gpu",)),
    # The host: collectors/hwmon.py, collectors/host.py
    Family("gpufleet_host_temperature_celsius", GAUGE, "Host temperature.", ("chip", "sensor")),
    Family(
        "gpufleet_host_temperature_critical_celsius",
        GAUGE,
        "Critical temperature: the chip's own (source hwmon), else the roster's (roster), else a "
        "known default for the chip (default).",
        ("chip", "sensor", "source"),
    ),
    Family(
        "gpufleet_host_cpu_seconds_total",
        COUNTER,
        "CPU time spent in each mode, summed over all CPUs (guest time is in user/nice).",
        ("mode",),
    ),
    Family("gpufleet_host_memory_total_bytes", GAUGE, "Physical memory.", ()),
    Family(
        "gpufleet_host_memory_available_bytes",
        GAUGE,
        "Memory available to new processes without swapping (MemAvailable).",
        (),
    ),
    Family("gpufleet_host_memory_used_bytes", GAUGE, "Memory in use.", ()),
    Family("gpufleet_host_swap_total_bytes", GAUGE, "Swap space.", ()),
    Family("gpufleet_host_swap_used_bytes", GAUGE, "Swap in use.", ()),
    Family("gpufleet_host_load1", GAUGE, "Load average over 1 minute(s).", ()),
    Family("gpufleet_host_load5", GAUGE, "Load average over 5 minute(s).", ()),
    Family("gpufleet_host_load15", GAUGE, "Load average over 15 minute(s).", ()),
    Family("gpufleet_host_cpus", GAUGE, "Logical CPUs.", ()),
    # llama-server: collectors/llama.py
    Family("gpufleet_llama_up", GAUGE, "1 when /health answered 200.", ("server",)),
    Family(
        "gpufleet_llama_sleeping",
        GAUGE,
        "1 while the server sleeps (--sleep-idle-seconds: model unloaded), 0 awake, from /props "
        "is_sleeping; absent when unknown.",
        ("server",),
    ),
    Family(
        "gpufleet_llama_model_info",
        GAUGE,
        "A model a router (--models-dir, --models-preset) lists in /models; the value is 1.",
        ("server", "served_model"),
    ),
    Family(
        "gpufleet_llama_model_state",
        GAUGE,
        "A router model's state, 0/1: unloaded, loading, loaded, sleeping, failed.",
        ("server", "served_model", "state"),
    ),
    Family(
        "gpufleet_llama_model_exit_code",
        GAUGE,
        "Exit code of a router model's child after a failed load.",
        ("server", "served_model"),
    ),
    Family(
        "gpufleet_llama_health",
        GAUGE,
        "/health's answer: ok, loading (503), error, unreachable (refused), timeout.",
        ("server", "state"),
    ),
    Family(
        "gpufleet_llama_info",
        GAUGE,
        "The server's identity: roster role, model and gpu (its card; empty when the roster gives "
        "none), llama-server's alias and build.",
        ("server", "role", "model", "alias", "build", "gpu"),
    ),
    Family(
        "gpufleet_llama_endpoint",
        GAUGE,
        "State of /metrics, /slots, /props and a router's /models: ok, busy (timed out or still in"
        " flight), disabled, error; absent when not asked this scrape (/slots of an idle server).",
        ("server", "endpoint", "state"),
    ),
    Family("gpufleet_llama_slots", GAUGE, "Slots by state.", ("server", "served_model", "state")),
    Family(
        "gpufleet_llama_context_tokens",
        GAUGE,
        "Context size per slot, in tokens.",
        ("server", "served_model"),
    ),
    Family(
        "gpufleet_llama_requests_processing",
        GAUGE,
        "Requests being processed.",
        ("server", "served_model"),
    ),
    Family(
        "gpufleet_llama_requests_deferred",
        GAUGE,
        "Requests waiting for a free slot.",
        ("server", "served_model"),
    ),
    Family(
        "gpufleet_llama_decode_calls_total",
        COUNTER,
        "llama_decode() calls: moves during generation.",
        ("server", "served_model"),
    ),
    Family(
        "gpufleet_llama_prompt_tokens_total",
        COUNTER,
        "Prompt tokens processed (moves when requests finish).",
        ("server", "served_model"),
    ),
    Family(
        "gpufleet_llama_predicted_tokens_total",
        COUNTER,
        "Tokens generated (moves when requests finish).",
        ("server", "served_model"),
    ),
    Family(
        "gpufleet_llama_prompt_seconds_total",
        COUNTER,
        "Time spent processing prompts.",
        ("server", "served_model"),
    ),
    Family(
        "gpufleet_llama_predicted_seconds_total",
        COUNTER,
        "Time spent generating tokens.",
        ("server", "served_model"),
    ),
    Family(
        "gpufleet_llama_prompt_tokens_cached_total",
        COUNTER,
        "Prompt tokens reused from the KV cache (not processed again).",
        ("server", "served_model"),
    ),
    Family(
        "gpufleet_llama_spec_drafts_total",
        COUNTER,
        "Speculative decoding: draft verification steps.",
        ("server", "served_model"),
    ),
    Family(
        "gpufleet_llama_spec_draft_tokens_total",
        COUNTER,
        "Speculative decoding: tokens drafted.",
        ("server", "served_model"),
    ),
    Family(
        "gpufleet_llama_spec_accepted_tokens_total",
        COUNTER,
        "Speculative decoding: drafted tokens the target model accepted.",
        ("server", "served_model"),
    ),
    Family(
        "gpufleet_llama_tokens_max",
        GAUGE,
        "Longest sequence (prompt + generation) seen since the server started, in tokens.",
        ("server", "served_model"),
    ),
    Family(
        "gpufleet_llama_slot_decoded_tokens",
        GAUGE,
        "Tokens decoded so far by the busy slot's request.",
        ("server", "served_model", "slot"),
    ),
    Family(
        "gpufleet_llama_slot_predict_limit",
        GAUGE,
        "The busy slot's request's n_predict; +Inf when it has no cap.",
        ("server", "served_model", "slot"),
    ),
    Family(
        "gpufleet_llama_slot_task_age_seconds",
        GAUGE,
        "How long the busy slot's task has run, since the exporter first saw it.",
        ("server", "served_model", "slot"),
    ),
    # vLLM: collectors/vllm.py
    Family(
        "gpufleet_vllm_info",
        GAUGE,
        "vLLM server identity; the value is 1. role, model and gpu (its card; empty when the "
        "roster gives none) from the roster, served_model is vLLM's model_name.",
        ("server", "role", "model", "served_model", "gpu"),
    ),
    Family("gpufleet_vllm_up", GAUGE, "1 when vLLM's /health answered 200.", ("server",)),
    Family(
        "gpufleet_vllm_endpoint",
        GAUGE,
        "1 for the state of a vLLM endpoint's read: ok, busy (timed out), disabled (404/501, or no"
        " vllm: series), error (refused, bad answer, unparsable).",
        ("server", "endpoint", "state"),
    ),
    Family(
        "gpufleet_vllm_requests_running",
        GAUGE,
        "Requests in vLLM's execution batches (vllm:num_requests_running, all engines).",
        ("server",),
    ),
    Family(
        "gpufleet_vllm_requests_waiting",
        GAUGE,
        "Requests waiting in vLLM's queue (vllm:num_requests_waiting, all engines).",
        ("server",),
    ),
    Family(
        "gpufleet_vllm_kv_cache_usage_ratio",
        GAUGE,
        "Share of vLLM's KV-cache blocks in use, 0-1 (vllm:kv_cache_usage_perc, mean over "
        "engines).",
        ("server",),
    ),
    Family(
        "gpufleet_vllm_prompt_tokens_total",
        COUNTER,
        "Prefill tokens processed by vLLM (vllm:prompt_tokens_total, all engines).",
        ("server",),
    ),
    Family(
        "gpufleet_vllm_generation_tokens_total",
        COUNTER,
        "Tokens generated by vLLM (vllm:generation_tokens_total, all engines).",
        ("server",),
    ),
    Family(
        "gpufleet_vllm_preemptions_total",
        COUNTER,
        "Requests preempted by vLLM's scheduler (vllm:num_preemptions_total, all engines).",
        ("server",),
    ),
    Family(
        "gpufleet_vllm_time_to_first_token_seconds",
        HISTOGRAM,
        "Time to first token (vllm:time_to_first_token_seconds, all engines).",
        ("server",),
    ),
    # Port ghosts: collectors/ports.py
    Family(
        "gpufleet_port_ghost",
        GAUGE,
        "1 when a process other than the server's unit listens on its port (or anything listens "
        "while the unit is not running), 0 when clean; absent when unknown.",
        ("server", "port"),
    ),
    Family(
        "gpufleet_port_listener_info",
        GAUGE,
        "1 for each process name listening on a roster server's port.",
        ("port", "comm"),
    ),
    Family(
        "gpufleet_port_listener_pid",
        GAUGE,
        "The pid of a process listening on a roster server's port (the lowest, when several of "
        "that name hold it).",
        ("port", "comm"),
    ),
    # systemd units and the servers' processes: collectors/units.py, collectors/server_memory.py
    Family(
        "gpufleet_unit_active",
        GAUGE,
        "1 when the unit's ActiveState is active.",
        ("server", "unit"),
    ),
    Family(
        "gpufleet_unit_state",
        GAUGE,
        "1 for the unit's ActiveState (active, reloading, inactive, failed, activating, "
        "deactivating), 0 for the others.",
        ("server", "unit", "state"),
    ),
    Family(
        "gpufleet_unit_sub_state_info",
        GAUGE,
        "The unit's SubState (running, auto-restart, failed...); the value is 1.",
        ("server", "unit", "sub_state"),
    ),
    # systemd flushes NRestarts at the first start after the unit stopped without restarting,
    # and on reset-failed (service.c, flush_n_restarts): a counter reset.
    Family(
        "gpufleet_unit_restarts_total",
        COUNTER,
        "Automatic restarts of the unit (NRestarts; back to 0 on a start after a stop).",
        ("server", "unit"),
    ),
    Family(
        "gpufleet_unit_main_pid",
        GAUGE,
        "PID of the unit's main process (MainPID).",
        ("server", "unit"),
    ),
    Family(
        "gpufleet_unit_state_change_timestamp_seconds",
        GAUGE,
        "Unix time the unit entered its current state (StateChangeTimestamp).",
        ("server", "unit"),
    ),
    Family(
        "gpufleet_unit_loaded",
        GAUGE,
        "1 when the unit's LoadState is loaded; 0 e.g. not-found: no such unit on the host.",
        ("server", "unit"),
    ),
    Family(
        "gpufleet_server_process_resident_memory_bytes",
        GAUGE,
        "Resident memory of the server's main process (VmRSS).",
        ("server",),
    ),
    Family(
        "gpufleet_server_process_cpu_seconds_total",
        COUNTER,
        "User and system CPU time of the server's main process.",
        ("server",),
    ),
    Family(
        "gpufleet_server_process_threads",
        GAUGE,
        "Threads of the server's main process.",
        ("server",),
    ),
    Family(
        "gpufleet_server_process_start_time_seconds",
        GAUGE,
        "Unix time the server's main process started.",
        ("server",),
    ),
    Family(
        "gpufleet_server_gpu_memory_bytes",
        GAUGE,
        "GPU memory held by the processes of a model server's unit.",
        ("server", "gpu"),
    ),
    Family(
        "gpufleet_gpu_unowned_memory_bytes",
        GAUGE,
        "GPU memory held by processes that belong to no roster server.",
        ("gpu",),
    ),
    # The canary: exporter/canary.py
    Family(
        "gpufleet_canary_tokens_per_second",
        GAUGE,
        "Throughput of the last canary completion, from llama-server's timings.",
        ("server", "served_model", "phase"),
    ),
    Family(
        "gpufleet_canary_last_run_timestamp_seconds",
        GAUGE,
        "When the last successful canary completion finished (Unix time).",
        ("server", "served_model"),
    ),
    Family(
        "gpufleet_canary_runs_total",
        COUNTER,
        "Canary attempts by outcome: ok, skipped_down, skipped_sleeping, skipped_busy, "
        "skipped_idle, skipped_unknown, error.",
        ("server", "outcome"),
    ),
    # The exporter itself: collectors/selfstats.py
    Family(
        "gpufleet_exporter_collector_success",
        GAUGE,
        "1 when the collector read its whole source in this scrape, 0 when part of it failed.",
        ("collector",),
    ),
    Family(
        "gpufleet_exporter_collector_duration_seconds",
        GAUGE,
        "Time the collector took in this scrape.",
        ("collector",),
    ),
    Family(
        "gpufleet_exporter_build_info",
        GAUGE,
        "The exporter's version and the Python running it.",
        ("version", "python_version"),
    ),
)

CATALOGUE: Mapping[str, Family] = MappingProxyType({f.name: f for f in _FAMILIES})


def _spec(name: str, kind: str) -> Family:
    spec = CATALOGUE.get(name)
    if spec is None:
        raise KeyError(f"{name}: not in the metric catalogue (exporter/collectors/catalogue.py)")
    if spec.type != kind:
        raise TypeError(f"{name} is a {spec.type} in the catalogue, not a {kind}")
    return spec


def gauge(name: str) -> GaugeMetricFamily:
    """A fresh, empty gauge family of the catalogue."""
    spec = _spec(name, GAUGE)
    return GaugeMetricFamily(spec.name, spec.help, labels=spec.labels)


def counter(name: str) -> CounterMetricFamily:
    """A fresh, empty counter family of the catalogue (`name` with its `_total`)."""
    spec = _spec(name, COUNTER)
    return CounterMetricFamily(spec.name, spec.help, labels=spec.labels)


def histogram(name: str) -> HistogramMetricFamily:
    """A fresh, empty histogram family of the catalogue."""
    spec = _spec(name, HISTOGRAM)
    return HistogramMetricFamily(spec.name, spec.help, labels=spec.labels)


def scalar(name: str) -> GaugeMetricFamily | CounterMetricFamily:
    """A fresh gauge or counter family, whichever the catalogue says (for tables of names)."""
    spec = CATALOGUE.get(name)
    if spec is not None and spec.type == COUNTER:
        return counter(name)
    return gauge(name)
