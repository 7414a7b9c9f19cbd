"""The journal: everything replicas must agree on, in SQLite or PostgreSQL."""
