"""GPU memory per process on AMD, from the DRM `fdinfo` of each open `/dev/dri` file.

The kernel's Documentation/gpu/drm-usage-stats.rst: every open DRM file shows, in
`/proc/PID/fdinfo/FD`, `drm-driver`, `drm-pdev` (the PCI device), `drm-client-id` (one per
open file description, shared by dup()ed and inherited fds) and memory per region, such as
`drm-memory-vram: 20971520 KiB` (amdgpu; newer kernels also write `drm-total-vram`,
`drm-resident-vram`). Units are an optional `KiB` or `MiB` suffix, else bytes.

Seeing other users' fds needs the same privilege as port-owner lookups: root, or
CAP_SYS_PTRACE + CAP_DAC_READ_SEARCH.

Manual check: `grep -H drm- /proc/$(pgrep -f llama-server)/fdinfo/*`.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field

_UNITS = {"KiB": 1024, "MiB": 1024 * 1024, "GiB": 1024**3}
# Prefer the key amdgpu has always written; the generic ones came with later kernels.
_VRAM_KEYS = ("drm-memory-vram", "drm-resident-vram", "drm-total-vram")


@dataclass
class DrmScan:
    """VRAM by (pid, PCI bus id), and the pids whose fds could not be read."""

    vram: dict[tuple[int, str], int] = field(default_factory=dict)
    hidden_pids: list[int] = field(default_factory=list)


def parse_fdinfo(text: str) -> tuple[str, str, int] | None:
    """`(pdev, client id, vram bytes)` of one amdgpu DRM fdinfo, or None for anything else."""
    values: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            values[key.strip()] = value.strip()
    if values.get("drm-driver") != "amdgpu" or "drm-pdev" not in values:
        return None
    for key in _VRAM_KEYS:
        if key in values:
            number, _, unit = values[key].partition(" ")
            try:
                vram = int(number) * _UNITS.get(unit.strip(), 1)
            except ValueError:
                return None
            return values["drm-pdev"].lower(), values.get("drm-client-id", ""), vram
    return None


Clients = dict[tuple[str, str], int]
"""VRAM bytes by (PCI bus id, DRM client id) of the amdgpu files one process has open."""


def process_clients(pid: int, *, procfs: str = "/proc") -> Clients | None:
    """The amdgpu DRM clients process `pid` has open, with their VRAM; None when hidden.

    None means the process's fds may not be read (EACCES/EPERM: another user's process without
    the privilege, or hidepid=): its memory is unknown. A process that is gone, or opens no
    amdgpu file, gives `{}`. A client without `drm-client-id` (kernels before 5.19) is keyed
    by its fd, so it is counted once for this process but never matched with another's.
    """
    fd_dir = os.path.join(procfs, str(pid), "fd")
    try:
        fds = os.listdir(fd_dir)
    except PermissionError:
        return None
    except OSError:  # gone since the listing
        return {}
    clients: Clients = {}
    for fd in fds:
        try:
            # Only DRM files have drm- keys; a readlink is cheaper than reading fdinfo.
            if not os.readlink(os.path.join(fd_dir, fd)).startswith("/dev/dri/"):
                continue
            with open(os.path.join(procfs, str(pid), "fdinfo", fd), encoding="ascii") as f:
                parsed = parse_fdinfo(f.read())
        except (OSError, UnicodeDecodeError):
            continue
        if parsed is None:
            continue
        pdev, client, vram = parsed
        clients.setdefault((pdev, client or f"fd:{pid}:{fd}"), vram)
    return clients


def scan(pids: Iterable[int], *, procfs: str = "/proc") -> DrmScan:
    """Sum each pid's VRAM per GPU, counting every DRM client once."""
    result = DrmScan()
    seen_clients: set[tuple[str, str]] = set()
    for pid in sorted(pids):  # sorted: a client shared after fork() goes to the parent
        clients = process_clients(pid, procfs=procfs)
        if clients is None:
            result.hidden_pids.append(pid)
            continue
        for (pdev, client), vram in clients.items():
            if (pdev, client) in seen_clients:
                continue
            seen_clients.add((pdev, client))
            key = (pid, pdev)
            result.vram[key] = result.vram.get(key, 0) + vram
    return result
