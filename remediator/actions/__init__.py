"""Actions: registered functions with typed params that playbook steps name.

Importing this package registers the built-in actions (`builtin.py`), so anything that loads
playbooks sees every action a step may name.
"""

from remediator.actions import builtin as builtin
