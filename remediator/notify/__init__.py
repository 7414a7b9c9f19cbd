"""Zulip reports for the remediator.

`report` renders them, `markdown` keeps alert text from breaking them and trims them to the
server's limit, `graph` draws the incident's picture, `zulip_api` adapts the `zulip` client,
and `sender` takes them out of the journal's outbox into Zulip.
"""
