"""The one catalogue of the exporter's metric families: name, type, help, labels and unit.

Every collector makes its families here (`gauge(NAME)`, `counter(NAME)`, `histogram(NAME)`),
so a family has one help text and one label set whichever collector emits it (NVIDIA and AMD
both emit `gpufleet_gpu_*`; before, the first collector's help text won). The metric reference,
docs/metrics.md, is generated from this list (`make docs`, docs/generate.py), and a test fails
when the page differs from what this list would give (tests/test_docs.py); a live scrape over
fixtures must produce exactly these families (tests/test_full_scrape.py).

Names are as exposed: counters end in `_total` (prometheus_client's CounterMetricFamily takes
the name with or without it and writes `_total` on the sample). Labels are in the order the
collectors pass values. The unit is the base unit the name ends with (Prometheus' naming guide).

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
    # What docs/metrics.md says of it (Markdown; `make docs` writes the page from here): the
    # values a label takes, where a value comes from, when the series is absent.
    doc: str = ""

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
        doc=("identity, value 1"),
    ),
    Family(
        "gpufleet_gpu_up",
        GAUGE,
        "1 when the GPU was read, 0 when read and lost or erroring; absent when not read.",
        ("gpu",),
        doc=(
            "1 read and readable, 0 read and lost or erroring; absent when not read this scrape "
            "(see `gpufleet_gpu_read_timeout`)"
        ),
    ),
    Family(
        "gpufleet_gpu_read_timeout",
        GAUGE,
        "1 when reading the GPU did not finish within the collector's deadline (its call hangs), 0"
        " when it was read this scrape; absent when it was not reached.",
        ("gpu",),
        doc=(
            "1 for the GPU whose read (an NVML call, an amdgpu sysfs read) did not finish within "
            "the deadline, 0 for every GPU read this scrape; absent for a GPU not reached (queued"
            " behind the stuck one)"
        ),
    ),
    Family(
        "gpufleet_gpu_compute_mode_expected",
        GAUGE,
        "1 for the compute mode the roster expects.",
        ("gpu", "mode"),
        doc=("the roster's `compute_mode`, 0/1 per mode"),
    ),
    Family(
        "gpufleet_gpu_xid_errors_total",
        COUNTER,
        "Xid errors reported by the driver.",
        ("gpu", "xid"),
        doc=("Xid errors by code (appears with the first)"),
    ),
    Family(
        "gpufleet_gpus_expected",
        GAUGE,
        "GPUs the roster expects, by vendor.",
        ("vendor",),
        doc=("GPUs the roster expects (only with a roster)"),
    ),
    Family(
        "gpufleet_gpus_lost",
        GAUGE,
        "Expected GPUs that are missing or down (GPUs not read this scrape excluded).",
        ("vendor",),
        doc=("expected GPUs neither up nor unread this scrape (only with a roster)"),
    ),
    Family(
        "gpufleet_gpu_utilization_ratio",
        GAUGE,
        "Share of the last sample period the GPU was busy, 0-1 (NVML utilization, amdgpu "
        "gpu_busy_percent).",
        ("gpu",),
        doc=("busy ratio, 0-1"),
    ),
    Family(
        "gpufleet_gpu_memory_utilization_ratio",
        GAUGE,
        "Share of the last sample period the GPU memory was accessed, 0-1 (NVML; amdgpu "
        "mem_busy_percent).",
        ("gpu",),
        doc=("memory controller busy ratio, 0-1"),
    ),
    Family(
        "gpufleet_gpu_memory_used_bytes",
        GAUGE,
        "GPU memory in use, by pool: vram, vis_vram, gtt (AMD); vram allocated and reserved by the"
        " driver (NVIDIA).",
        ("gpu", "pool"),
        doc=("pool `vram`, `vis_vram`, `gtt` (AMD), `reserved` (NVIDIA)"),
    ),
    Family(
        "gpufleet_gpu_memory_total_bytes",
        GAUGE,
        "GPU memory size, by pool.",
        ("gpu", "pool"),
        doc=("pool `vram`, `vis_vram`, `gtt`"),
    ),
    Family(
        "gpufleet_gpu_temperature_celsius",
        GAUGE,
        "GPU temperature, by sensor (NVIDIA gpu, memory; AMD edge, junction, mem).",
        ("gpu", "sensor"),
        doc=("NVIDIA `gpu`, `memory`; AMD `edge`, `junction`, `mem`"),
    ),
    Family(
        "gpufleet_gpu_temperature_critical_celsius",
        GAUGE,
        "The hardware's critical temperature (NVML shutdown threshold, memory max; amdgpu "
        "temp*_crit).",
        ("gpu", "sensor"),
        doc=("the hardware's limit: NVML shutdown (memory: max), amdgpu `temp*_crit`"),
    ),
    Family(
        "gpufleet_gpu_temperature_slowdown_celsius",
        GAUGE,
        "Temperature at which the hardware slows its clocks (NVML slowdown threshold).",
        ("gpu", "sensor"),
        doc=("NVML slowdown threshold"),
    ),
    Family(
        "gpufleet_gpu_power_watts",
        GAUGE,
        "GPU power draw.",
        ("gpu",),
        doc=("draw (AMD `power1_input`, else `power1_average`)"),
    ),
    Family(
        "gpufleet_gpu_power_limit_watts",
        GAUGE,
        "GPU power limits: current (enforced; amdgpu power1_cap), default, min, max.",
        ("gpu", "kind"),
        doc=("kind `current` (enforced / `power1_cap`), `default`, `min`, `max`"),
    ),
    Family(
        "gpufleet_gpu_energy_joules_total",
        COUNTER,
        "GPU energy used since the driver loaded.",
        ("gpu",),
        doc=("energy counter"),
    ),
    Family(
        "gpufleet_gpu_fan_speed_ratio",
        GAUGE,
        "Intended fan speed, 0-1 (NVIDIA).",
        ("gpu",),
        doc=("NVIDIA fan speed, 0-1"),
    ),
    Family(
        "gpufleet_gpu_clock_hertz",
        GAUGE,
        "Current clock frequency, by clock.",
        ("gpu", "clock"),
        doc=("clock `sm`, `memory`, `graphics` (AMD sclk = `graphics`, mclk = `memory`)"),
    ),
    Family(
        "gpufleet_gpu_clock_max_hertz",
        GAUGE,
        "Highest clock frequency, by clock.",
        ("gpu", "clock"),
        doc=("the clocks' maxima"),
    ),
    Family(
        "gpufleet_gpu_throttle_active",
        GAUGE,
        "1 while the clock-event (throttle) reason holds clocks down.",
        ("gpu", "reason"),
        doc=("0/1 per NVIDIA clock-event reason"),
    ),
    Family(
        "gpufleet_gpu_pcie_link_generation",
        GAUGE,
        "Current PCIe link generation.",
        ("gpu",),
        doc=("current PCIe generation"),
    ),
    Family(
        "gpufleet_gpu_pcie_link_width",
        GAUGE,
        "Current PCIe link width (lanes).",
        ("gpu",),
        doc=("current PCIe width (lanes)"),
    ),
    Family(
        "gpufleet_gpu_pcie_replay_errors_total",
        COUNTER,
        "PCIe replays.",
        ("gpu",),
        doc=("PCIe replay counter"),
    ),
    Family(
        "gpufleet_gpu_ecc_errors_total",
        COUNTER,
        "ECC errors, lifetime (aggregate).",
        ("gpu", "kind"),
        doc=("kind `corrected`, `uncorrected` (aggregate)"),
    ),
    Family(
        "gpufleet_gpu_retired_pages",
        GAUGE,
        "Retired memory pages, by cause.",
        ("gpu", "cause"),
        doc=("cause `single_bit_ecc`, `double_bit_ecc`"),
    ),
    Family(
        "gpufleet_gpu_retired_pages_pending",
        GAUGE,
        "1 when a page retirement waits for the next driver reload.",
        ("gpu",),
        doc=("0/1"),
    ),
    Family(
        "gpufleet_gpu_remapped_rows",
        GAUGE,
        "Remapped memory rows, by kind.",
        ("gpu", "kind"),
        doc=("kind `correctable`, `uncorrectable`"),
    ),
    Family(
        "gpufleet_gpu_remapped_rows_pending",
        GAUGE,
        "1 when a row remapping waits for a GPU reset.",
        ("gpu",),
        doc=("0/1"),
    ),
    Family(
        "gpufleet_gpu_remapped_rows_failed",
        GAUGE,
        "1 when a row remapping failed (the GPU needs service).",
        ("gpu",),
        doc=("0/1"),
    ),
    Family(
        "gpufleet_gpu_compute_mode",
        GAUGE,
        "1 for the GPU's NVML compute mode.",
        ("gpu", "mode"),
        doc=("0/1 per mode: `default`, `exclusive_thread`, `prohibited`, `exclusive_process`"),
    ),
    Family(
        "gpufleet_gpu_temperature_emergency_celsius",
        GAUGE,
        "The GPU's emergency (shutdown) temperature (amdgpu temp*_emergency).",
        ("gpu", "sensor"),
        doc=("amdgpu `temp*_emergency`"),
    ),
    Family(
        "gpufleet_gpu_fan_speed_rpm",
        GAUGE,
        "Fan speed (AMD).",
        ("gpu",),
        doc=("AMD fan speed"),
    ),
    # The host: collectors/hwmon.py, collectors/host.py
    Family(
        "gpufleet_host_temperature_celsius",
        GAUGE,
        "Host temperature.",
        ("chip", "sensor"),
        doc=("every hwmon temperature but the GPUs' (`k10temp`/`Tctl` on AMD APUs)"),
    ),
    Family(
        "gpufleet_host_temperature_critical_celsius",
        GAUGE,
        "Critical temperature: the chip's own (source hwmon), else the roster's (roster), else a "
        "known default for the chip (default).",
        ("chip", "sensor", "source"),
        doc=(
            'from hwmon (`source="hwmon"`), else the roster\'s `thermal` (`roster`), else a '
            "default per known chip (`default`: k10temp `Tctl`/`Tdie` the AMD CPU's Tjmax from "
            "`/proc/cpuinfo`: 100 on Strix Halo and Zen 5 mobile APUs, 95 on Zen 4 and Zen 5 "
            "desktop/server, else 90)"
        ),
    ),
    Family(
        "gpufleet_host_temperature_read_timeout",
        GAUGE,
        "1 when the hwmon chip's read did not return within the collector timeout (its "
        "temperatures are absent this scrape), else 0.",
        ("chip",),
        doc=(
            "per hwmon chip with temperatures: 1 while its sysfs read is stuck past "
            "`--collector.timeout` (an nvme admin command, an I2C sensor in D state), else 0"
        ),
    ),
    Family(
        "gpufleet_host_cpu_seconds_total",
        COUNTER,
        "CPU time spent in each mode, summed over all CPUs (guest time is in user/nice).",
        ("mode",),
        doc=(
            "CPU time per mode (`user`, `nice`, `system`, `idle`, `iowait`, `irq`, `softirq`, "
            "`steal`), summed over CPUs; the utilisation is the recording rule "
            "`host:gpufleet_host_cpu_utilization_ratio:rate5m`"
        ),
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
    Family(
        "gpufleet_host_load1",
        GAUGE,
        "Load average over 1 minute(s).",
        (),
        doc=("load average, 1 minute"),
    ),
    Family(
        "gpufleet_host_load5",
        GAUGE,
        "Load average over 5 minute(s).",
        (),
        doc=("load average, 5 minutes"),
    ),
    Family(
        "gpufleet_host_load15",
        GAUGE,
        "Load average over 15 minute(s).",
        (),
        doc=("load average, 15 minutes"),
    ),
    Family(
        "gpufleet_host_cpus",
        GAUGE,
        "Logical CPUs.",
        (),
        doc=("logical CPUs"),
    ),
    # llama-server: collectors/llama.py
    Family(
        "gpufleet_llama_up",
        GAUGE,
        "1 when /health answered 200.",
        ("server",),
        doc=("1 when llama-server's `/health` answered 200"),
    ),
    Family(
        "gpufleet_llama_sleeping",
        GAUGE,
        "1 while the server sleeps (--sleep-idle-seconds: model unloaded), 0 awake, from /props "
        "is_sleeping; absent when unknown.",
        ("server",),
        doc=(
            "1 while the server sleeps (`--sleep-idle-seconds`: model unloaded), 0 awake, from "
            "`/props` `is_sleeping`; absent when unknown (and for a router: see "
            "`gpufleet_llama_model_state`)"
        ),
    ),
    Family(
        "gpufleet_llama_model_info",
        GAUGE,
        "A model a router (--models-dir, --models-preset) lists in /models; the value is 1.",
        ("server", "served_model"),
        doc=("router mode: a model `/models` lists"),
    ),
    Family(
        "gpufleet_llama_model_state",
        GAUGE,
        "A router model's state, 0/1: unloaded, loading, loaded, sleeping, failed.",
        ("server", "served_model", "state"),
        doc=("router mode: 0/1 per state `unloaded`, `loading`, `loaded`, `sleeping`, `failed`"),
    ),
    Family(
        "gpufleet_llama_model_exit_code",
        GAUGE,
        "Exit code of a router model's child after a failed load.",
        ("server", "served_model"),
        doc=("router mode: the child's exit code, only after a failed load"),
    ),
    Family(
        "gpufleet_llama_health",
        GAUGE,
        "/health's answer: ok, loading (503), error, unreachable (refused), timeout.",
        ("server", "state"),
        doc=("0/1 per state: `ok`, `loading` (503), `error`, `unreachable` (refused), `timeout`"),
    ),
    Family(
        "gpufleet_llama_info",
        GAUGE,
        "The server's identity: roster role, model and gpu (its card; empty when the roster gives "
        "none), llama-server's alias and build.",
        ("server", "role", "model", "alias", "build", "gpu"),
        doc=(
            "identity: roster role and model, llama-server's `-a` alias and build (`/props` "
            "`build_info`; empty when it is `b0-unknown`, a build without git metadata), the "
            "roster's `gpu` of the server (empty where it gives none; the server alerts carry it)"
            " — one series per server, router or not"
        ),
    ),
    Family(
        "gpufleet_llama_endpoint",
        GAUGE,
        "State of /metrics, /slots, /props and a router's /models: ok, busy (timed out or still in"
        " flight), disabled, error; absent when not asked this scrape (/slots of an idle server).",
        ("server", "endpoint", "state"),
        doc=(
            "0/1; endpoint `metrics`, `slots`, `props`, `models` (router); state `ok`, `busy` "
            "(timed out or still in flight), `disabled` (501/404), `error`; absent when not asked"
            " this scrape (`/slots` of an idle or sleeping server); a router's summarise its "
            "loaded models (worst first)"
        ),
    ),
    Family(
        "gpufleet_llama_slots",
        GAUGE,
        "Slots by state.",
        ("server", "served_model", "state"),
        doc=("slots `busy`, `idle`; absent while the server sleeps"),
    ),
    Family(
        "gpufleet_llama_context_tokens",
        GAUGE,
        "Context size per slot, in tokens.",
        ("server", "served_model"),
        doc=("context per slot"),
    ),
    Family(
        "gpufleet_llama_requests_processing",
        GAUGE,
        "Requests being processed.",
        ("server", "served_model"),
        doc=("requests in slots"),
    ),
    Family(
        "gpufleet_llama_requests_deferred",
        GAUGE,
        "Requests waiting for a free slot.",
        ("server", "served_model"),
        doc=("requests waiting for a slot"),
    ),
    Family(
        "gpufleet_llama_decode_calls_total",
        COUNTER,
        "llama_decode() calls: moves during generation.",
        ("server", "served_model"),
        doc=(
            "`llama_decode()` calls: moves during generation (printed with 6 significant "
            "digits: docs/exporter.md)"
        ),
    ),
    Family(
        "gpufleet_llama_prompt_tokens_total",
        COUNTER,
        "Prompt tokens processed (moves when requests finish).",
        ("server", "served_model"),
        doc=("prompt tokens (moves when a request finishes)"),
    ),
    Family(
        "gpufleet_llama_predicted_tokens_total",
        COUNTER,
        "Tokens generated (moves when requests finish).",
        ("server", "served_model"),
        doc=("generated tokens (moves when a request finishes)"),
    ),
    Family(
        "gpufleet_llama_prompt_seconds_total",
        COUNTER,
        "Time spent processing prompts.",
        ("server", "served_model"),
        doc=("time spent on prompts"),
    ),
    Family(
        "gpufleet_llama_predicted_seconds_total",
        COUNTER,
        "Time spent generating tokens.",
        ("server", "served_model"),
        doc=("time spent generating"),
    ),
    Family(
        "gpufleet_llama_prompt_tokens_cached_total",
        COUNTER,
        "Prompt tokens reused from the KV cache (not processed again).",
        ("server", "served_model"),
        doc=("prompt tokens reused from the KV cache"),
    ),
    Family(
        "gpufleet_llama_spec_drafts_total",
        COUNTER,
        "Speculative decoding: draft verification steps.",
        ("server", "served_model"),
        doc=("speculative decoding: draft verification steps"),
    ),
    Family(
        "gpufleet_llama_spec_draft_tokens_total",
        COUNTER,
        "Speculative decoding: tokens drafted.",
        ("server", "served_model"),
        doc=("speculative decoding: tokens drafted"),
    ),
    Family(
        "gpufleet_llama_spec_accepted_tokens_total",
        COUNTER,
        "Speculative decoding: drafted tokens the target model accepted.",
        ("server", "served_model"),
        doc=(
            "speculative decoding: drafted tokens accepted; the ratio is "
            "`server:gpufleet_llama_spec_acceptance_ratio:rate5m`"
        ),
    ),
    Family(
        "gpufleet_llama_tokens_max",
        GAUGE,
        "Longest sequence (prompt + generation) seen since the server started, in tokens.",
        ("server", "served_model"),
        doc=("longest sequence seen (prompt + generation), llama.cpp's `n_tokens_max`"),
    ),
    Family(
        "gpufleet_llama_slot_decoded_tokens",
        GAUGE,
        "Tokens decoded so far by the busy slot's request.",
        ("server", "served_model", "slot"),
        doc=("per busy slot: tokens decoded so far (exact: `/slots` `n_decoded`)"),
    ),
    Family(
        "gpufleet_llama_slot_predict_limit",
        GAUGE,
        "The busy slot's request's n_predict; +Inf when it has no cap.",
        ("server", "served_model", "slot"),
        doc=("per busy slot: the request's `n_predict`, `+Inf` without a cap"),
    ),
    Family(
        "gpufleet_llama_slot_task_age_seconds",
        GAUGE,
        "How long the busy slot's task has run, since the exporter first saw it.",
        ("server", "served_model", "slot"),
        doc=("per busy slot: age of its task, since the exporter first saw it"),
    ),
    # vLLM: collectors/vllm.py
    Family(
        "gpufleet_vllm_info",
        GAUGE,
        "vLLM server identity; the value is 1. role, model and gpu (its card; empty when the "
        "roster gives none) from the roster, served_model is vLLM's model_name.",
        ("server", "role", "model", "served_model", "gpu"),
        doc=(
            "identity: roster role and model, vLLM's `model_name`, the roster's `gpu` (empty "
            "where it gives none)"
        ),
    ),
    Family(
        "gpufleet_vllm_up",
        GAUGE,
        "1 when vLLM's /health answered 200.",
        ("server",),
        doc=("1 when vLLM's `/health` answered 200"),
    ),
    Family(
        "gpufleet_vllm_endpoint",
        GAUGE,
        "1 for the state of a vLLM endpoint's read: ok, busy (timed out), disabled (404/501, or no"
        " vllm: series), error (refused, bad answer, unparsable).",
        ("server", "endpoint", "state"),
        doc=("0/1; endpoint `metrics`; state `ok`, `busy`, `disabled`, `error`"),
    ),
    Family(
        "gpufleet_vllm_requests_running",
        GAUGE,
        "Requests in vLLM's execution batches (vllm:num_requests_running, all engines).",
        ("server",),
        doc=("`vllm:num_requests_running`, summed over engines"),
    ),
    Family(
        "gpufleet_vllm_requests_waiting",
        GAUGE,
        "Requests waiting in vLLM's queue (vllm:num_requests_waiting, all engines).",
        ("server",),
        doc=("`vllm:num_requests_waiting`"),
    ),
    Family(
        "gpufleet_vllm_kv_cache_usage_ratio",
        GAUGE,
        "Share of vLLM's KV-cache blocks in use, 0-1 (vllm:kv_cache_usage_perc, mean over "
        "engines).",
        ("server",),
        doc=("`vllm:kv_cache_usage_perc` (0-1; older `gpu_cache_usage_perc`), mean over engines"),
    ),
    Family(
        "gpufleet_vllm_prompt_tokens_total",
        COUNTER,
        "Prefill tokens processed by vLLM (vllm:prompt_tokens_total, all engines).",
        ("server",),
        doc=("`vllm:prompt_tokens_total`"),
    ),
    Family(
        "gpufleet_vllm_generation_tokens_total",
        COUNTER,
        "Tokens generated by vLLM (vllm:generation_tokens_total, all engines).",
        ("server",),
        doc=("`vllm:generation_tokens_total`"),
    ),
    Family(
        "gpufleet_vllm_preemptions_total",
        COUNTER,
        "Requests preempted by vLLM's scheduler (vllm:num_preemptions_total, all engines).",
        ("server",),
        doc=("`vllm:num_preemptions_total`"),
    ),
    Family(
        "gpufleet_vllm_time_to_first_token_seconds",
        HISTOGRAM,
        "Time to first token (vllm:time_to_first_token_seconds, all engines).",
        ("server",),
        doc=("histogram (`_bucket`, `_sum`, `_count`) of `vllm:time_to_first_token_seconds`"),
    ),
    # Port ghosts: collectors/ports.py
    Family(
        "gpufleet_port_ghost",
        GAUGE,
        "1 when a process other than the server's unit listens on its port (or anything listens "
        "while the unit is not running), 0 when clean; absent when unknown.",
        ("server", "port"),
        doc=(
            "1 when a process that is not the unit's listens on the server's port, or anything "
            "listens while the unit is not running; 0 clean; absent when it cannot be known (no "
            "privilege, systemctl failing)"
        ),
    ),
    Family(
        "gpufleet_port_listener_info",
        GAUGE,
        "1 for each process name listening on a roster server's port.",
        ("port", "comm"),
        doc=(
            "1 for each process name listening on a roster server's port (no `pid` label: a "
            "restart is not a new series)"
        ),
    ),
    Family(
        "gpufleet_port_listener_pid",
        GAUGE,
        "The pid of a process listening on a roster server's port (the lowest, when several of "
        "that name hold it).",
        ("port", "comm"),
        doc=("the pid of that listener (the lowest, when several of that name hold the port)"),
    ),
    # systemd units and the servers' processes: collectors/units.py, collectors/server_memory.py
    Family(
        "gpufleet_unit_active",
        GAUGE,
        "1 when the unit's ActiveState is active.",
        ("server", "unit"),
        doc=("1 when the unit's ActiveState is `active`, else 0"),
    ),
    Family(
        "gpufleet_unit_state",
        GAUGE,
        "1 for the unit's ActiveState (active, reloading, inactive, failed, activating, "
        "deactivating), 0 for the others.",
        ("server", "unit", "state"),
        doc=(
            "0/1 per state `active`, `reloading`, `inactive`, `failed`, `activating`, "
            "`deactivating` (a start loop is `activating`)"
        ),
    ),
    Family(
        "gpufleet_unit_sub_state_info",
        GAUGE,
        "The unit's SubState (running, auto-restart, failed...); the value is 1.",
        ("server", "unit", "sub_state"),
        doc=("the unit's SubState (`running`, `auto-restart`, `failed`…), value 1"),
    ),
    # systemd flushes NRestarts at the first start after the unit stopped without restarting,
    # and on reset-failed (service.c, flush_n_restarts): a counter reset.
    Family(
        "gpufleet_unit_restarts_total",
        COUNTER,
        "Automatic restarts of the unit (NRestarts; back to 0 on a start after a stop).",
        ("server", "unit"),
        doc=("automatic restarts (systemd `NRestarts`)"),
    ),
    Family(
        "gpufleet_unit_main_pid",
        GAUGE,
        "PID of the unit's main process (MainPID).",
        ("server", "unit"),
        doc=("PID of the unit's main process; absent when it has none"),
    ),
    Family(
        "gpufleet_unit_state_change_timestamp_seconds",
        GAUGE,
        "Unix time the unit entered its current state (StateChangeTimestamp).",
        ("server", "unit"),
        doc=("Unix time the unit entered its state"),
    ),
    Family(
        "gpufleet_unit_loaded",
        GAUGE,
        "1 when the unit's LoadState is loaded; 0 e.g. not-found: no such unit on the host.",
        ("server", "unit"),
        doc=(
            "1 when LoadState is `loaded`; 0 e.g. `not-found`: the roster names a unit this host "
            "lacks"
        ),
    ),
    Family(
        "gpufleet_server_process_resident_memory_bytes",
        GAUGE,
        "Resident memory of the server's main process (VmRSS).",
        ("server",),
        doc=("resident memory of the unit's main process"),
    ),
    Family(
        "gpufleet_server_process_cpu_seconds_total",
        COUNTER,
        "User and system CPU time of the server's main process.",
        ("server",),
        doc=("user + system CPU time of the main process"),
    ),
    Family(
        "gpufleet_server_process_threads",
        GAUGE,
        "Threads of the server's main process.",
        ("server",),
        doc=("threads of the main process"),
    ),
    Family(
        "gpufleet_server_process_start_time_seconds",
        GAUGE,
        "Unix time the server's main process started.",
        ("server",),
        doc=("Unix time the main process started"),
    ),
    Family(
        "gpufleet_server_gpu_memory_bytes",
        GAUGE,
        "GPU memory held by the processes of a model server's unit.",
        ("server", "gpu"),
        doc=(
            "GPU memory held by the processes of the server's unit (NVML compute and MPS "
            "processes, AMD DRM fdinfo); absent where a process list is incomplete (NVML "
            "NO_PERMISSION/NOT_SUPPORTED, `usedGpuMemory` unknown, fds hidden)"
        ),
    ),
    Family(
        "gpufleet_gpu_unowned_memory_bytes",
        GAUGE,
        "GPU memory held by processes that belong to no roster server.",
        ("gpu",),
        doc=(
            "GPU memory held by processes of no roster server (a ghost, the MPS server, other "
            "programs); absent where unknown, as above; on AMD the last finished budgeted walk of"
            " /proc"
        ),
    ),
    # The canary: exporter/canary.py
    Family(
        "gpufleet_canary_tokens_per_second",
        GAUGE,
        "Throughput of the last canary completion, from llama-server's timings.",
        ("server", "served_model", "phase"),
        doc=("the last canary completion's tok/s, phase `generation`, `prompt`"),
    ),
    Family(
        "gpufleet_canary_last_run_timestamp_seconds",
        GAUGE,
        "When the last successful canary completion finished (Unix time).",
        ("server", "served_model"),
        doc=("when the last canary completion finished"),
    ),
    Family(
        "gpufleet_canary_runs_total",
        COUNTER,
        "Canary attempts by outcome: ok, skipped_down, skipped_sleeping, skipped_busy, "
        "skipped_idle, skipped_unknown, error.",
        ("server", "outcome"),
        doc=(
            "canary attempts: `ok`, `skipped_down`, `skipped_sleeping`, `skipped_busy`, "
            "`skipped_idle`, `skipped_unknown`, `error`"
        ),
    ),
    # The exporter itself: collectors/selfstats.py
    Family(
        "gpufleet_exporter_collector_success",
        GAUGE,
        "1 when the collector read its whole source in this scrape, 0 when part of it failed.",
        ("collector",),
        doc=(
            "1 when the collector read its whole source (`nvidia`, `amd`, `hwmon`, `host`, "
            "`llama`, `vllm`, `canary`, `units`, `ports`, `server_memory`)"
        ),
    ),
    Family(
        "gpufleet_exporter_collector_duration_seconds",
        GAUGE,
        "Time the collector took in this scrape.",
        ("collector",),
        doc=("time the collector took"),
    ),
    Family(
        "gpufleet_exporter_series_dropped_total",
        COUNTER,
        "Series the exporter left out, by collector, server (empty when none) and reason.",
        ("collector", "server", "reason"),
        doc=(
            "`reason`: `unrenderable` (a label value that cannot be written as UTF-8 text: the "
            "whole family is left out and the collector reads `collector_success 0`; one "
            "series per collector from the start, at 0, `server` empty); `slots_over_budget` "
            "and `models_over_budget` (a llama-server's per-slot or per-model series past its "
            "roster budget `max_slots`/`max_models`; one series per llama server and reason "
            "from the start, at 0)"
        ),
    ),
    Family(
        "gpufleet_exporter_build_info",
        GAUGE,
        "The exporter's version, the Python running it, and its NVML backend (fake: a stand-in).",
        ("version", "python_version", "nvml"),
        doc=(
            "value 1; `nvml` is `nvidia-ml-py` (the real library), or `fake` when "
            "`--nvml.fake-scenario` stands in for the GPUs: never in production"
        ),
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
