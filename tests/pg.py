"""Throwaway PostgreSQL databases for tests, on the server this machine runs (127.0.0.1:5432).

Independent of pytest, so the engine's HA tests, benchmarks and child processes can use it:

    with throwaway_database() as url:      # postgresql://postgres@127.0.0.1:5432/gpufleet_test_…
        journal = Journal(url, replica_id="a")

Each database has a random name, so parallel runs never collide, and is dropped on exit
(`WITH (FORCE)`: a child process still holding a connection does not block the drop).
Databases a killed run left behind share the prefix; `drop_leftovers()` removes them.

A server that cannot be reached raises `PostgresUnavailable` with a message that says what
to do: the HA tests must fail on a machine without PostgreSQL, never skip (a skipped test
reports green for code that never ran against the database it is for).
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from contextlib import contextmanager

import psycopg
from psycopg import sql

SERVER = "postgresql://postgres@127.0.0.1:5432"
"""The local server (trust auth for `postgres` on loopback), without a database name."""

PREFIX = "gpufleet_test_"


class PostgresUnavailable(RuntimeError):
    """The local PostgreSQL server cannot be reached or refused to create a database."""


def _admin(server: str) -> psycopg.Connection[tuple[object, ...]]:
    try:
        # CREATE/DROP DATABASE cannot run inside a transaction: autocommit.
        return psycopg.connect(f"{server}/postgres", autocommit=True, connect_timeout=5)
    except psycopg.OperationalError as exc:
        raise PostgresUnavailable(
            f"PostgreSQL at {server.rpartition('@')[2]} is not reachable ({exc}). The journal's "
            "PostgreSQL tests (and the HA tests) need the real server: install and start it "
            "(Debian: `apt-get install postgresql && pg_ctlcluster 15 main start`) with trust "
            "auth for user `postgres` on 127.0.0.1."
        ) from exc


def create_database(server: str = SERVER) -> str:
    """Create an empty database with a random name; its URL (`postgresql://…/name`)."""
    name = PREFIX + secrets.token_hex(6)
    with _admin(server) as conn:
        try:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        except psycopg.Error as exc:
            raise PostgresUnavailable(f"cannot create database {name}: {exc}") from exc
    return f"{server}/{name}"


def drop_database(url: str) -> None:
    """Drop a database `create_database` made (connections to it are terminated)."""
    server, _, name = url.rpartition("/")
    if not name.startswith(PREFIX):
        raise ValueError(f"refusing to drop {name!r}: not a throwaway test database")
    with _admin(server) as conn:
        conn.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
        )


def drop_leftovers(server: str = SERVER) -> list[str]:
    """Drop every throwaway database (of a killed earlier run, say); their names."""
    with _admin(server) as conn:
        names = [
            str(row[0])
            for row in conn.execute(
                "SELECT datname FROM pg_database WHERE datname LIKE %s",
                (PREFIX.replace("_", r"\_") + "%",),
            )
        ]
    for name in names:
        drop_database(f"{server}/{name}")
    return names


@contextmanager
def throwaway_database(server: str = SERVER) -> Iterator[str]:
    """A fresh database's URL for the `with` block; dropped afterwards."""
    url = create_database(server)
    try:
        yield url
    finally:
        drop_database(url)
