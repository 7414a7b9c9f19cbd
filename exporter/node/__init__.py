"""`gpu-fleet-node`: the host-side helper: allow-listed actions, and the port guard.

Two ways to call it, the same verbs::

    gpu-fleet-node --config ROSTER --host NAME --ssh          # SSH forced command
    gpu-fleet-node --config ROSTER --host NAME VERB ARGS...   # local (the local executor)

Under `--ssh` (`command="sudo /opt/gpu-fleet/bin/gpu-fleet-node --config ... --host NAME
--ssh",restrict` in `authorized_keys`) the verb and its arguments come from
`SSH_ORIGINAL_COMMAND` only: split on single spaces, each word a plain name
(`^[A-Za-z0-9][A-Za-z0-9._@:-]{0,127}$`), at most 4 words; anything else (`;`, `$( )`, quotes,
backticks, `|`, `/`, a newline, an empty word) is refused before anything is looked at. Then
every argument is checked against *this* host's section of the roster: a SERVER must be one
of its servers, a GPU one its `power_cap_watts` names (by index or bus id), WATTS within those
bounds.

Verbs (`exporter.node.protocol`):

- `status SERVER`: the unit's state (`systemctl show`), the port's listeners, ghost or not;
- `evidence SERVER`: status, port owners, the main process, the unit's last 50 journal lines,
  the GPU processes (each part best-effort);
- `restart|stop|start SERVER`: `systemctl ACTION UNIT`, then wait (`--wait-seconds`, 30) for
  `active` (restart: with a new main process) or `inactive`/`failed`;
- `guard-port SERVER`: the port guard (`exporter.node.guard`);
- `check-config` (local only, not under `--ssh`): the roster checked and this host found in it,
  nothing else touched;
- `power-cap GPU WATTS PCI_BUS_ID`, `power-cap-restore GPU PCI_BUS_ID`: NVML's power limit or
  amdgpu's `power1_cap`, the previous value recorded under `--state-dir` (`exporter.node.gpus`);
  refused unless this host numbers GPU `GPU` as the card `PCI_BUS_ID` (`exporter.sources.pci`).

The answer is one JSON line on stdout, `{"ok", "verb", "args", "host", "result", "error"}`;
the log line on stderr (and syslog under `--ssh`). Exit codes: 0 done, 1 tried and failed,
2 refused (nothing was done).

`guard-port` as a plain subcommand keeps the semantics of the server unit's `ExecStartPre=`
(with systemd's `+` prefix, so it runs with full privileges even when the unit has `User=`)::

    ExecStartPre=+/opt/gpu-fleet/bin/gpu-fleet-node guard-port %i --config /etc/gpu-fleet/...

exit 1 only when another program holds the port (or it stays held); when the guard cannot
check (no roster, an unknown server, no privilege, a bad flag) it says so loudly and exits 0:
it must never be the reason a healthy server cannot start (`ok: false` in its JSON says it).
Under `--ssh` the remediator gets the strict answer: anything but a usable port is exit 1.

`--nvml.fake-scenario FILE` answers NVML from the fake backend: a STAND-IN FOR A GPU, for
tests and demos only.
"""

from exporter.node.cli import _parser, main

__all__ = ["_parser", "main"]
