"""Listening TCP sockets and the processes that hold them, read from procfs.

Two steps, each cheap enough for every scrape:

1. `read_listeners`: the listening sockets, as `<procfs>/net/tcp` and `tcp6` list them
   (proc(5), "tcp"): one line per socket, `local_address` as `HEXADDR:HEXPORT`, `st` the TCP
   state (`0A` is TCP_LISTEN in include/net/tcp_states.h), then `uid` and the socket's `inode`.
   For the live `/proc` the same records are asked of the kernel over NETLINK_SOCK_DIAG
   (sock_diag(7), what `ss` uses), filtered to the LISTEN state in the kernel: reading
   `/proc/net/tcp` walks every bucket of the established-connections hash table (262,144 on a
   24 GiB machine, more on larger ones), about 1.2 ms per file even with no connection at all,
   while a LISTEN-only dump walks only the listening table. The files remain the source for an
   injected procfs tree and the fallback when sock_diag is unavailable.
2. `find_holders`: which processes hold a socket inode. Every open file of a process is a link
   in `<procfs>/PID/fd/`, and a socket's link reads `socket:[INODE]` (proc(5), "/proc/pid/fd").
   Remembered holders are re-checked first (one readlink each), then a given candidate set (the
   unit's processes), and the rest of /proc only when a socket is still unaccounted for.

What a holder is (comm, executable, owner, start time) is `sources/procfs.process_info`.

Privilege: `/proc/PID/fd` of another user's process is mode 0500 and owned by that user, and the
kernel also requires ptrace read access to it (proc_fd_permission → ptrace_may_access with
PTRACE_MODE_READ_FSCREDS). Root, or CAP_SYS_PTRACE together with CAP_DAC_READ_SEARCH, can read
it; anyone else gets EACCES. That refusal is recorded (`HolderScan.denied`), so callers can tell
"could not see who holds it" from "nobody holds it". Listing the sockets needs no privilege.

Manual check: `ss -ltnp 'sport = :31001'` (as root: without privilege `ss` shows no process).
"""

from __future__ import annotations

import errno
import os
import socket
import struct
import sys
import time
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from exporter.sources.procfs import all_pids

# What reading other users' `/proc/PID/fd` takes (see "Privilege" above); ports and GPU memory
# per process both need it and say so in their messages.
FD_PRIVILEGE = "root, or CAP_SYS_PTRACE and CAP_DAC_READ_SEARCH"
TCP_LISTEN = "0A"  # include/net/tcp_states.h: TCP_LISTEN = 10
# EACCES from the fd directory's mode, EPERM from the ptrace access check (both happen).
_DENIED = (errno.EACCES, errno.EPERM)


class ProcNetError(Exception):
    """The listening sockets (or the process list) could not be read from procfs."""


@dataclass(frozen=True)
class Listener:
    """One listening TCP socket."""

    port: int
    address: str  # the local address, "0.0.0.0", "::", "127.0.0.1", "::1", ...
    inode: int
    uid: int  # the socket's owner (the uid of the process that created it)
    family: int  # socket.AF_INET or socket.AF_INET6


@dataclass
class HolderScan:
    """What `find_holders` found: holders by inode, and processes it was not allowed to read."""

    holders: dict[int, set[int]] = field(default_factory=dict)  # inode -> pids holding it
    denied: set[int] = field(default_factory=set)  # pids whose fds we may not read
    scanned: set[int] = field(default_factory=set)  # pids whose fd directory was read (or tried)
    listed: set[int] = field(default_factory=set)  # pids whose fd directory was read: seen whole
    full_scan: bool = False  # True when the rest of /proc had to be read
    # False when a `deadline` stopped the read of the rest of /proc before its end: the
    # unresolved inodes may yet have a holder among the processes not read.
    complete: bool = True
    # Where each holder was found, inode -> (pid, fd name): hints for the next scan, which
    # re-checks them with one readlink each before reading anything else.
    places: dict[int, tuple[int, str]] = field(default_factory=dict)
    hinted: set[int] = field(default_factory=set)  # inodes confirmed by a hint

    def unresolved(self, inodes: Iterable[int]) -> set[int]:
        """Those of `inodes` for which no holder was found."""
        return {inode for inode in inodes if not self.holders.get(inode)}


# ---------------------------------------------------------------------------------------------
# Listeners
# ---------------------------------------------------------------------------------------------


def url_port(url: str) -> int:
    """The TCP port a server URL names: its explicit port, else 443 for https and 80 for http."""
    parts = urlsplit(url)
    return parts.port or (443 if parts.scheme == "https" else 80)


def _address(hex_address: str) -> str:
    """A `/proc/net/tcp*` address as text.

    The kernel prints the address as 32-bit words in *host* byte order (`%08X` of each
    `__be32`), so on a little-endian machine the bytes of every word come out reversed.
    """
    raw = bytes.fromhex(hex_address)
    if sys.byteorder == "little":
        raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    family = socket.AF_INET if len(raw) == 4 else socket.AF_INET6
    return socket.inet_ntop(family, raw)


def parse_listeners(text: str, family: int, ports: Collection[int] | None = None) -> list[Listener]:
    """The listening sockets of one `/proc/net/tcp` or `tcp6` text; only `ports` when given."""
    found = []
    for line in text.splitlines()[1:]:  # the first line is the column header
        # sl local_address rem_address st tx:rx tr:when retrnsmt uid timeout inode ...
        fields = line.split(None, 10)
        if len(fields) < 10 or fields[3] != TCP_LISTEN:
            continue
        hex_address, _, hex_port = fields[1].partition(":")
        try:
            port = int(hex_port, 16)
            if ports is not None and port not in ports:
                continue
            inode = int(fields[9])
            uid = int(fields[7])
            address = _address(hex_address)
        except ValueError:
            continue  # a malformed line: skip it rather than lose every other listener
        if inode:  # 0 only for sockets without a file (none listen, but never match those)
            found.append(Listener(port, address, inode, uid, family))
    return found


def read_procfs_listeners(
    procfs: str = "/proc", ports: Collection[int] | None = None
) -> list[Listener]:
    """The listening sockets of `<procfs>/net/tcp` and `tcp6`; raises `ProcNetError`.

    A missing `net/tcp6` is a kernel without IPv6 (the file exists only when the ipv6 module is
    loaded), not an error.
    """
    found: list[Listener] = []
    for name, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        path = os.path.join(procfs, "net", name)
        try:
            with open(path, encoding="ascii", errors="replace") as f:
                text = f.read()
        except FileNotFoundError:
            if family == socket.AF_INET6:
                continue
            raise ProcNetError(f"{path}: missing") from None
        except OSError as exc:
            raise ProcNetError(f"{path}: cannot read: {exc.strerror or exc}") from None
        found.extend(parse_listeners(text, family, ports))
    return found


# <linux/netlink.h>, <linux/sock_diag.h>, <linux/inet_diag.h>
_NETLINK_SOCK_DIAG = 4
_SOCK_DIAG_BY_FAMILY = 20
_NLM_F_REQUEST = 0x1
_NLM_F_DUMP = 0x300  # NLM_F_ROOT | NLM_F_MATCH
_NLMSG_ERROR = 2
_NLMSG_DONE = 3
_NLMSG_HEADER = struct.Struct("=IHHII")  # len, type, flags, seq, pid
# inet_diag_req_v2: family, protocol, ext, pad, states; then a zeroed inet_diag_sockid (48 B).
_DIAG_REQUEST = struct.Struct("=BBBBI48x")
# inet_diag_msg: family, state, timer, retrans; sockid (sport, dport big-endian; src, dst 16 B
# each; if; cookie 8 B); expires, rqueue, wqueue, uid, inode.
_DIAG_MESSAGE = struct.Struct("=BBBB2s2s16s16sI8sIIIII")
_TCPF_LISTEN = 1 << 10  # 1 << TCP_LISTEN


class SockDiagUnavailable(Exception):
    """NETLINK_SOCK_DIAG cannot answer (no inet_diag in the kernel, a seccomp filter, ...)."""


def _diag_dump(sock: socket.socket, family: int, seq: int) -> list[bytes]:
    """The inet_diag_msg payloads of one LISTEN-only TCP dump of `family`."""
    payload = _DIAG_REQUEST.pack(family, socket.IPPROTO_TCP, 0, 0, _TCPF_LISTEN)
    header = _NLMSG_HEADER.pack(
        _NLMSG_HEADER.size + len(payload),
        _SOCK_DIAG_BY_FAMILY,
        _NLM_F_REQUEST | _NLM_F_DUMP,
        seq,
        0,
    )
    sock.send(header + payload)
    messages: list[bytes] = []
    while True:
        data = sock.recv(65536)
        if not data:
            raise SockDiagUnavailable("the netlink socket closed mid-dump")
        offset = 0
        while offset + _NLMSG_HEADER.size <= len(data):
            length, kind, _, _, _ = _NLMSG_HEADER.unpack_from(data, offset)
            if length < _NLMSG_HEADER.size:
                raise SockDiagUnavailable(f"malformed netlink message (length {length})")
            body = data[offset + _NLMSG_HEADER.size : offset + length]
            if kind == _NLMSG_DONE:
                return messages
            if kind == _NLMSG_ERROR:
                (code,) = struct.unpack_from("=i", body)
                raise SockDiagUnavailable(os.strerror(-code) if code else "netlink error")
            if kind == _SOCK_DIAG_BY_FAMILY:
                messages.append(body)
            offset += (length + 3) & ~3  # NLMSG_ALIGN


def read_sock_diag_listeners(ports: Collection[int] | None = None) -> list[Listener]:
    """The listening TCP sockets of this process's network namespace, from sock_diag(7).

    Raises `SockDiagUnavailable` when the kernel cannot answer. IPv6 answering "no such
    family" (ENOENT: the ipv6 module is not loaded) is a kernel without IPv6, not an error.
    """
    found: list[Listener] = []
    try:
        with socket.socket(
            socket.AF_NETLINK, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC, _NETLINK_SOCK_DIAG
        ) as sock:
            sock.settimeout(2.0)  # answered at once by the kernel; bounded all the same
            for seq, family in enumerate((socket.AF_INET, socket.AF_INET6), start=1):
                try:
                    messages = _diag_dump(sock, family, seq)
                except SockDiagUnavailable:
                    if family == socket.AF_INET6:
                        continue
                    raise
                for body in messages:
                    if len(body) < _DIAG_MESSAGE.size:
                        continue
                    fields = _DIAG_MESSAGE.unpack_from(body)
                    port = int.from_bytes(fields[4], "big")
                    if ports is not None and port not in ports:
                        continue
                    raw = fields[6][:4] if fields[0] == socket.AF_INET else fields[6]
                    address = socket.inet_ntop(fields[0], raw)
                    uid, inode = fields[13], fields[14]
                    if inode:
                        found.append(Listener(port, address, inode, uid, fields[0]))
    except OSError as exc:
        raise SockDiagUnavailable(f"NETLINK_SOCK_DIAG: {exc.strerror or exc}") from None
    return found


def read_listeners(
    *, procfs: str = "/proc", ports: Collection[int] | None = None
) -> dict[int, list[Listener]]:
    """Listening TCP sockets (IPv4 and IPv6) by local port; only `ports` when given.

    For the live `/proc`, from sock_diag (fast; see the module docstring), falling back to the
    files; for any other procfs root, from its `net/tcp` and `net/tcp6`. Raises `ProcNetError`
    when neither can be read.
    """
    wanted = None if ports is None else frozenset(ports)
    listeners = None
    if procfs == "/proc":  # /proc/net is this process's network namespace, as sock_diag's is
        try:
            listeners = read_sock_diag_listeners(wanted)
        except SockDiagUnavailable:
            listeners = None
    if listeners is None:
        listeners = read_procfs_listeners(procfs, wanted)
    by_port: dict[int, list[Listener]] = {}
    for listener in listeners:
        by_port.setdefault(listener.port, []).append(listener)
    return by_port


# ---------------------------------------------------------------------------------------------
# Holders
# ---------------------------------------------------------------------------------------------


def _scan_process(pid: int, procfs: str, targets: dict[str, int], scan: HolderScan) -> None:
    """Record which of `targets` (`socket:[INODE]` -> inode) process `pid` holds."""
    fd_dir = os.path.join(procfs, str(pid), "fd")
    scan.scanned.add(pid)
    try:
        names = os.listdir(fd_dir)
    except OSError as exc:
        # ENOENT/ESRCH: the process exited meanwhile (or the pid was never there): it holds
        # nothing. Only a refusal means "could not see".
        if exc.errno in _DENIED:
            scan.denied.add(pid)
        return
    scan.listed.add(pid)
    for name in names:
        try:
            target = os.readlink(os.path.join(fd_dir, name))
        except OSError as exc:
            # The fd was closed between the listing and the read; or, for a process that
            # changed credentials since the listing (setuid), we may no longer look.
            if exc.errno in _DENIED:
                scan.denied.add(pid)
                scan.listed.discard(pid)
                return
            continue
        inode = targets.get(target)
        if inode is not None:
            scan.holders.setdefault(inode, set()).add(pid)
            scan.places.setdefault(inode, (pid, name))


def find_holders(
    inodes: Collection[int],
    candidates: Iterable[int] = (),
    *,
    procfs: str = "/proc",
    rest: bool = True,
    all_holders: bool = False,
    previous: HolderScan | None = None,
    hints: Mapping[int, tuple[int, str]] | None = None,
    skip: Collection[int] = (),
    deadline: float | None = None,
) -> HolderScan:
    """Which processes hold the sockets `inodes`.

    `hints` (a previous scan's `places`) are checked first: a remembered `(pid, fd)` that still
    links to the socket is a holder, for one readlink. Then the `candidates` are read. When some
    inode is still without a holder (or always, with `all_holders`) and `rest` is true, every
    other process of `procfs` is read too, stopping as soon as each inode has a holder unless
    `all_holders` asks for every one. `previous` continues an earlier scan for (a superset of)
    the same inodes: its findings are kept and its processes not read again. `skip` names
    processes an earlier, unfinished pass already read without finding the inodes. With a
    `deadline` (`time.monotonic()`), the read of the rest of /proc stops once it has passed (at
    least one process is read, so a pass continued over several calls always ends) and
    `complete` says whether it reached the end. Raises `ProcNetError` when `procfs` cannot be
    listed.
    """
    scan = previous if previous is not None else HolderScan()
    if not inodes:
        return scan
    targets = {f"socket:[{inode}]": inode for inode in inodes}

    def done() -> bool:
        return not all_holders and not scan.unresolved(inodes)

    for inode, (pid, fd) in (hints or {}).items():
        if f"socket:[{inode}]" not in targets:
            continue
        try:
            target = os.readlink(os.path.join(procfs, str(pid), "fd", fd))
        except OSError:
            continue  # gone, closed, or not ours to see: the reads below will tell
        if target == f"socket:[{inode}]":
            scan.holders.setdefault(inode, set()).add(pid)
            scan.places[inode] = (pid, fd)
            scan.hinted.add(inode)
    for pid in candidates:
        if done():
            return scan
        if pid not in scan.scanned:
            _scan_process(pid, procfs, targets, scan)
    if not rest or done():
        return scan
    scan.full_scan = True
    pids = all_pids(procfs)
    if pids is None:
        raise ProcNetError(f"{procfs}: cannot list processes")
    read_one = False
    for pid in pids:
        if pid in scan.scanned or pid in skip:
            continue
        if read_one and deadline is not None and time.monotonic() > deadline:
            scan.complete = False
            break
        _scan_process(pid, procfs, targets, scan)
        read_one = True
        if done():
            break
    return scan
