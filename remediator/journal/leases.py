"""Leases: one named role held by one replica at a time (the Zulip sender, power-cap restores).

The journal's one compare-and-set lock: a row of `locks` (target `lease/NAME`) taken with an
INSERT that the primary key lets only one replica make, renewed by its holder, and taken over
once it expired with an UPDATE conditioned on the holder and expiry seen, so two replicas can
never both hold it. A per-target lock is not a lease: it is the disruption set of a running
run, decided by the rails (`rails.py`).
"""

from __future__ import annotations

from datetime import timedelta

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from remediator.journal.db import ATTEMPTS, Database
from remediator.journal.schema import locks


class Leases(Database):
    """Named leases in the `locks` table."""

    def take_lease(self, name: str, ttl: timedelta, *, owner: str | None = None) -> bool:
        """Hold the lease `name` for `ttl` from now (taken, renewed, or taken over once expired).

        False while another replica holds it unexpired. One row of the `locks` table (target
        `lease/NAME`, run 0), so two replicas cannot both hold it (see the module).
        """
        target = f"lease/{name}"
        holder = owner if owner is not None else self.replica_id

        def body(conn: Connection) -> bool:
            for _ in range(ATTEMPTS):
                now = self._clock()
                held = {
                    "run_id": 0,
                    "owner": holder,
                    "expires_at": now + ttl,
                    "ttl_seconds": ttl.total_seconds(),
                }
                inserted = conn.execute(
                    self._insert(locks)
                    .values(target=target, acquired_at=now, **held)
                    .on_conflict_do_nothing(index_elements=["target"])
                    .returning(locks.c.target)
                ).first()
                if inserted is not None:
                    return True
                current = conn.execute(sa.select(locks).where(locks.c.target == target)).first()
                if current is None:
                    continue  # released in between: try again
                mine = current.owner == holder
                if not mine and current.expires_at > now:
                    return False
                values = held if mine else {**held, "acquired_at": now}
                taken = conn.execute(
                    sa.update(locks)
                    .where(
                        locks.c.target == target,
                        locks.c.owner == current.owner,
                        locks.c.expires_at == current.expires_at,
                    )
                    .values(**values)
                ).rowcount
                if taken:
                    return True
            return False

        return self._tx("take a lease", body)

    def lease_holder(self, name: str) -> str | None:
        """Who holds the lease `name` now (expired or not); None when nobody does."""
        query = sa.select(locks.c.owner).where(locks.c.target == f"lease/{name}")
        found = self._tx("read a lease", lambda conn: conn.execute(query).scalar(), write=False)
        return None if found is None else str(found)

    def release_lease(self, name: str, *, owner: str | None = None) -> None:
        """Give the lease `name` up if this replica (or `owner`) holds it (a no-op otherwise)."""
        holder = owner if owner is not None else self.replica_id
        self._tx(
            "release a lease",
            lambda conn: conn.execute(
                sa.delete(locks).where(locks.c.target == f"lease/{name}", locks.c.owner == holder)
            ),
        )
