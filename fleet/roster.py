"""The roster (`fleet.yaml`): typed models, complete validation on load, and host resolution.

The roster is the one source of truth shared by the exporter, `gpu-fleet-node` and the
remediator: hosts, the GPUs each must have, and every model server with its engine, URL,
systemd unit, role alias and model. Every key is documented in docs/roster.md; keys are
added, never renamed. Unknown keys are refused so that a typo (`servrs:`) stops the start
instead of silently watching nothing.

Every error names the file and the key path, e.g.
`fleet.yaml: hosts.dioscuri.servers.alpha.engine: must be one of 'llama', 'vllm'`.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from fleet.gpu_index import normalize_pci_bus_id
from fleet.yamlfile import load_strict

DEFAULT_ROSTER_PATH = Path("/etc/gpu-fleet/fleet.yaml")
DEFAULT_HOST_FILE = Path("/etc/gpu-fleet/host")
DEFAULT_EXPORTER_PORT = 9445

# Names end up in Prometheus labels, unit names and (later) SSH arguments checked against the
# roster: keep them to a conservative alphabet so none of them can smuggle shell syntax.
_NAME = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$"
_UNIT = r"^[A-Za-z0-9][A-Za-z0-9_.@:-]{0,200}\.service$"
# A hostname per RFC 1123 (labels of letters, digits and hyphens).
_LABEL = r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_HOSTNAME = re.compile(rf"^(?=.{{1,253}}$){_LABEL}(\.{_LABEL})*$")

Name = Annotated[str, Field(pattern=_NAME)]
# YAML 1.1 (PyYAML) reads an unquoted `0000:41:00.0` as a base-60 number (2460.0).
_UNQUOTED_BUS_ID = (
    "{!r} is a number: quote PCI bus ids ('0000:41:00.0'), which YAML otherwise reads as "
    "base-60 numbers"
)
ComputeMode = Literal["default", "exclusive_thread", "prohibited", "exclusive_process"]


class RosterError(Exception):
    """The roster cannot be used; the message names the file and every bad key path."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SshSettings(_Strict):
    """How the remediator reaches the host over SSH (the rest comes from ~/.ssh/config)."""

    user: Name | None = None
    port: int | None = Field(default=None, ge=1, le=65535)


class VendorGpus(_Strict):
    """What a host must have of one vendor's GPUs.

    `pci_bus_ids` (optional) lists the cards by PCI bus id (`0000:41:00.0`, as `lspci -D`
    prints it): a listed card keeps its place in the `gpu` numbering even while it is missing,
    so the other cards' indices do not move when one fails to come up at boot.
    """

    count: int = Field(ge=0)
    compute_mode: ComputeMode | None = None
    pci_bus_ids: tuple[str, ...] | None = None

    @field_validator("pci_bus_ids", mode="before")
    @classmethod
    def _quoted(cls, value: object) -> object:
        if isinstance(value, list | tuple):
            for position, item in enumerate(value):
                if isinstance(item, float):
                    raise ValueError(f"item {position}: " + _UNQUOTED_BUS_ID.format(item))
        return value

    @field_validator("pci_bus_ids")
    @classmethod
    def _bus_ids(cls, value: tuple[str, ...] | None) -> tuple[str, ...] | None:
        if value is None:
            return None
        normal = []
        for position, raw in enumerate(value):
            try:
                normal.append(normalize_pci_bus_id(raw))
            except ValueError:
                raise ValueError(
                    f"item {position}: {raw!r} is not a PCI bus id (e.g. '0000:41:00.0')"
                ) from None
        if len(set(normal)) != len(normal):
            raise ValueError("a PCI bus id is listed twice")
        return tuple(normal)

    @model_validator(mode="after")
    def _count_matches(self) -> VendorGpus:
        if self.pci_bus_ids is not None and len(self.pci_bus_ids) != self.count:
            raise ValueError(
                f"pci_bus_ids: lists {len(self.pci_bus_ids)} GPU(s), count says {self.count}"
            )
        return self


class HostGpus(_Strict):
    """The GPUs a host must have, by vendor (an AMD iGPU beside NVIDIA cards is fine)."""

    nvidia: VendorGpus | None = None
    amd: VendorGpus | None = None

    @model_validator(mode="after")
    def _compute_mode_is_nvidia_only(self) -> HostGpus:
        # Compute modes are an NVML concept; amdgpu has nothing to compare them with.
        if self.amd is not None and self.amd.compute_mode is not None:
            raise ValueError("amd.compute_mode: compute modes exist only for NVIDIA GPUs")
        return self

    @model_validator(mode="after")
    def _bus_ids_distinct(self) -> HostGpus:
        nvidia = set(self.nvidia.pci_bus_ids or ()) if self.nvidia else set()
        amd = set(self.amd.pci_bus_ids or ()) if self.amd else set()
        if nvidia & amd:
            raise ValueError(f"{', '.join(sorted(nvidia & amd))}: listed for nvidia and amd")
        return self

    def expected_pci_bus_ids(self) -> list[str]:
        """The PCI bus ids the roster lists, every vendor's, sorted."""
        vendors = [v for v in (self.nvidia, self.amd) if v is not None]
        return sorted(bus for v in vendors for bus in v.pci_bus_ids or ())

    def lists_every_bus_id(self) -> bool:
        """Whether every vendor the roster names lists its cards' bus ids (at least one does)."""
        vendors = [v for v in (self.nvidia, self.amd) if v is not None]
        return bool(vendors) and all(v.pci_bus_ids is not None for v in vendors)


class PowerBounds(_Strict):
    """Bounds a power-cap action must stay within for one GPU."""

    min: float = Field(gt=0)
    max: float = Field(gt=0)

    @model_validator(mode="after")
    def _ordered(self) -> PowerBounds:
        if self.min > self.max:
            raise ValueError(f"min ({self.min}) is above max ({self.max})")
        return self


class ThermalLimit(_Strict):
    """A critical temperature for a sensor whose hardware reports none (k10temp `Tctl`)."""

    critical_celsius: float = Field(gt=0, le=150)


class Canary(_Strict):
    """The canary throughput probe of one llama-server (off unless the server has this key)."""

    interval_seconds: float = Field(default=300.0, ge=10, le=86400)
    max_tokens: int = Field(default=64, ge=1, le=4096)
    timeout_seconds: float = Field(default=60.0, gt=0, le=600)


def _http_url(value: str) -> str:
    """`value` if it is an http(s) URL with a host (and a valid port), without a trailing /."""
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError("must be an http:// or https:// URL with a host")
    try:
        _ = parts.port
    except ValueError as exc:
        raise ValueError(f"bad port: {exc}") from None
    return value.rstrip("/")


def _absolute_path(value: Path | None) -> Path | None:
    # Relative paths would depend on the working directory of whichever program reads them.
    if value is not None and not value.is_absolute():
        raise ValueError("must be an absolute path")
    return value


class LiteLlm(_Strict):
    """The LiteLLM proxy that routes to a server: the remediator drains through its admin API.

    `model_id` is the deployment's id in the proxy (`model_info.id`, what `/model/block` and
    `/model/unblock` name); the admin (master) key is read from `admin_key_file` on each use.
    """

    url: str
    model_id: Annotated[str, Field(min_length=1, max_length=200, pattern=r"^\S+$")]
    admin_key_file: Path

    @field_validator("url")
    @classmethod
    def _url(cls, value: str) -> str:
        return _http_url(value)

    @field_validator("admin_key_file")
    @classmethod
    def _key_file(cls, value: Path) -> Path:
        _absolute_path(value)
        return value


class Server(_Strict):
    """A model server: a llama-server or vLLM process under a systemd unit."""

    engine: Literal["llama", "vllm"]
    url: str
    unit: Annotated[str, Field(pattern=_UNIT)]
    role: Name
    model: Annotated[str, Field(min_length=1, max_length=200)]
    gpu: int | None = Field(default=None, ge=0)
    api_key_file: Path | None = None
    timeout_seconds: float = Field(default=2.0, gt=0, le=60)
    canary: Canary | None = None
    litellm: LiteLlm | None = None
    # A llama-server in router mode (--models-dir / --models-preset: one child per model).
    # Optional: the exporter detects it from /props (`role: "router"`); `true` makes it read
    # as a router from the first scrape, even while /props does not answer.
    router: bool | None = None
    # Cardinality budgets (the exporter's): per-slot series of at most this many busy slots,
    # and at most this many router models, each with its own series. What is past a budget is
    # left out and counted (gpufleet_exporter_series_dropped_total).
    max_slots: int = Field(default=256, ge=1, le=100_000)
    max_models: int = Field(default=64, ge=1, le=10_000)

    @model_validator(mode="after")
    def _canary_needs_llama(self) -> Server:
        # The probe reads llama-server's `timings`; vLLM's answers have none.
        if self.canary is not None and self.engine != "llama":
            raise ValueError("canary: the throughput probe works with engine llama only")
        return self

    @field_validator("url")
    @classmethod
    def _http_url(cls, value: str) -> str:
        return _http_url(value)

    @field_validator("api_key_file")
    @classmethod
    def _absolute(cls, value: Path | None) -> Path | None:
        return _absolute_path(value)


class Host(_Strict):
    """One GPU host of the fleet."""

    address: str
    exporter_port: int = Field(default=DEFAULT_EXPORTER_PORT, ge=1, le=65535)
    ssh: SshSettings | None = None
    local: bool = False
    gpus: HostGpus = HostGpus()
    # Keyed by `gpu` index or by PCI bus id (the card itself, whatever its index).
    power_cap_watts: dict[int | str, PowerBounds] = {}
    thermal: dict[str, ThermalLimit] = {}
    servers: dict[Name, Server] = {}

    @field_validator("address")
    @classmethod
    def _address(cls, value: str) -> str:
        try:
            ipaddress.ip_address(value)
        except ValueError:
            if not _HOSTNAME.match(value):
                raise ValueError("must be an IP address or a hostname") from None
        return value

    @field_validator("power_cap_watts", mode="before")
    @classmethod
    def _gpu_keys(cls, value: object) -> object:
        # YAML gives `0:` as an int and `0000:41:00.0:` (quoted or not) as a string; a key is a
        # `gpu` index or a PCI bus id, normalised so that `41:00.0` and `0000:41:00.0` are one.
        if not isinstance(value, Mapping):
            return value
        keys: dict[int | str, object] = {}
        for key, bounds in value.items():
            if isinstance(key, float):
                raise ValueError(_UNQUOTED_BUS_ID.format(key))
            text = str(key).strip()
            normal: int | str
            if isinstance(key, int) or text.isdigit():
                normal = int(text)
                if normal < 0:
                    raise ValueError(f"key {key!r}: `gpu` indices are >= 0")
            else:
                try:
                    normal = normalize_pci_bus_id(text)
                except ValueError:
                    raise ValueError(
                        f"key {key!r} is neither a `gpu` index (0, 1, ...) nor a PCI bus id "
                        "('0000:41:00.0')"
                    ) from None
            if normal in keys:
                raise ValueError(f"key {key!r}: GPU {normal} is given twice")
            keys[normal] = bounds
        return keys

    def power_bounds(self, index: int, pci_bus_id: str | None) -> PowerBounds | None:
        """The roster's power-cap bounds for this GPU: by its bus id, else by its index.

        A bus-id key names the card itself, so it wins over an index key for the same GPU.
        """
        if pci_bus_id is not None:
            bounds = self.power_cap_watts.get(normalize_pci_bus_id(pci_bus_id))
            if bounds is not None:
                return bounds
        return self.power_cap_watts.get(index)

    @field_validator("thermal")
    @classmethod
    def _chip_sensor(cls, value: dict[str, ThermalLimit]) -> dict[str, ThermalLimit]:
        for key in value:
            chip, sep, sensor = key.partition("/")
            if not sep or not chip or not sensor:
                raise ValueError(f"key {key!r} must be 'chip/sensor', e.g. 'k10temp/Tctl'")
        return value

    @model_validator(mode="after")
    def _gpu_references(self) -> Host:
        # A server or a power bound naming a GPU the host is not expected to have is a typo
        # that would otherwise surface only when an action targets it.
        vendors = [v for v in (self.gpus.nvidia, self.gpus.amd) if v is not None]
        if not vendors:
            return self
        total = sum(v.count for v in vendors)
        for name, server in self.servers.items():
            if server.gpu is not None and server.gpu >= total:
                raise ValueError(
                    f"servers.{name}.gpu: {server.gpu} is not among the host's {total} GPU(s)"
                )
        listed = self.gpus.expected_pci_bus_ids() if self.gpus.lists_every_bus_id() else None
        for key in self.power_cap_watts:
            if isinstance(key, int) and key >= total:
                raise ValueError(
                    f"power_cap_watts.{key}: the host has {total} GPU(s), numbered from 0"
                )
            if isinstance(key, str) and listed is not None and key not in listed:
                raise ValueError(
                    f"power_cap_watts.{key}: not among the host's listed PCI bus ids "
                    f"({', '.join(listed)})"
                )
        return self

    @model_validator(mode="after")
    def _ports_unique(self) -> Host:
        seen: dict[tuple[str, int | None], str] = {}
        for name, server in self.servers.items():
            parts = urlsplit(server.url)
            key = (parts.hostname or "", parts.port)
            if key in seen:
                raise ValueError(
                    f"servers {seen[key]!r} and {name!r} share the address {server.url}"
                )
            seen[key] = name
        return self

    def thermal_criticals(self) -> dict[str, float]:
        """The roster's critical temperatures, `"chip/sensor"` to °C."""
        return {key: limit.critical_celsius for key, limit in self.thermal.items()}


class Roster(_Strict):
    """The whole fleet."""

    hosts: dict[Name, Host]


def _key_path(loc: tuple[int | str, ...]) -> str:
    return ".".join(str(part) for part in loc) or "(top level)"


def format_validation_error(source: str, exc: ValidationError) -> str:
    """Every problem of a validation error, one line each: `source: key.path: message`."""
    lines = []
    for err in exc.errors():
        message = err["msg"]
        if err["type"] == "extra_forbidden":
            message = "unknown key (check its spelling against docs/roster.md)"
        elif err["type"] == "missing":
            message = "required key is missing"
        message = message.removeprefix("Value error, ")
        lines.append(f"{source}: {_key_path(tuple(err['loc']))}: {message}")
    return "\n".join(lines)


def parse_roster(data: Any, source: str) -> Roster:
    """Validate already-loaded YAML data; `source` names it in errors."""
    if not isinstance(data, Mapping):
        raise RosterError(f"{source}: (top level): must be a mapping with a `hosts` key")
    try:
        return Roster.model_validate(data)
    except ValidationError as exc:
        raise RosterError(format_validation_error(source, exc)) from None


def load_roster(path: Path) -> Roster:
    """Read and validate a roster file; `RosterError` names the file and every bad key."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise RosterError(f"{path}: cannot read: {exc.strerror or exc}") from None
    try:
        data = load_strict(text)
    except yaml.YAMLError as exc:
        raise RosterError(f"{path}: not valid YAML: {exc}") from None
    return parse_roster(data, str(path))


def resolve_host_name(
    roster: Roster,
    explicit: str | None,
    *,
    host_file: Path = DEFAULT_HOST_FILE,
    hostname: Callable[[], str] = socket.gethostname,
) -> str:
    """Which roster host this machine is.

    In order: `--host`, else the name in `/etc/gpu-fleet/host`, else the machine's hostname
    (or its first label) when the roster has it. Raises `RosterError` otherwise.
    """
    if explicit is not None:
        if explicit not in roster.hosts:
            raise RosterError(f"--host {explicit!r}: no such host in the roster ({_known(roster)})")
        return explicit
    try:
        from_file = host_file.read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        from_file = ""
    except OSError as exc:
        raise RosterError(f"{host_file}: cannot read: {exc.strerror or exc}") from None
    if from_file:
        if from_file not in roster.hosts:
            raise RosterError(
                f"{host_file}: names host {from_file!r}, which the roster lacks ({_known(roster)})"
            )
        return from_file
    name = hostname()
    for candidate in (name, name.split(".", 1)[0]):
        if candidate in roster.hosts:
            return candidate
    raise RosterError(
        f"cannot tell which roster host this is: no --host, no {host_file}, and the hostname "
        f"{name!r} is not in the roster ({_known(roster)})"
    )


def _known(roster: Roster) -> str:
    names = sorted(roster.hosts)
    return "hosts: " + ", ".join(names) if names else "it has no hosts"
