"""Actions: registered functions with typed params that playbook steps name.

Importing this package registers every built-in action, so anything that loads playbooks sees
every action a step may name:
- `builtin.py`: `wait`, `prometheus_check`, `http_probe` (no host access);
- `host.py`: `capture_evidence`, `restart_server`, `kill_port_ghost`, `escalate` (through
  `gpu-fleet-node`, `executors/`);
- `serving.py`: `drain` (+ `litellm_unblock`), `wait_healthy`, `canary_benchmark`;
- `power.py`: `set_power_cap` and the durable restore the engine's heartbeat runs;
- `integrations.py`: `http_request` (allow-listed URLs), `redis_delete` (allow-listed keys).
"""

from remediator.actions import builtin as builtin
from remediator.actions import host as host
from remediator.actions import integrations as integrations
from remediator.actions import power as power
from remediator.actions import serving as serving
