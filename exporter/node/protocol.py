"""The wire protocol of `gpu-fleet-node`: tokens, verbs, the JSON answer and the exit codes.

A request is a verb and its arguments, each a *token*: `^[A-Za-z0-9][A-Za-z0-9._@:-]{0,127}$`.
Under `--ssh` they come from `SSH_ORIGINAL_COMMAND`, split on single spaces; a token that does
not match (an empty one from a doubled space, one holding `;`, `$`, quotes, `/`, a backtick, a
tab or a newline, one starting with `-`), or more than `MAX_TOKENS` of them, refuse the whole
request before anything else is looked at. The answer is one JSON object on one line of
stdout::

    {"ok": true, "verb": "status", "args": ["alpha"], "host": "dioscuri",
     "result": {...}, "error": null}

Exit codes: 0 done; 1 the action was tried and failed; 2 refused (nothing was done).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

EXIT_DONE = 0
EXIT_FAILED = 1
EXIT_REFUSED = 2

TOKEN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._@:-]{0,127}$")
MAX_TOKENS = 4
# Longer than any valid command (4 tokens of 128 characters and 3 spaces): refused unread.
MAX_COMMAND_CHARS = MAX_TOKENS * 129
MAX_OUTPUT_BYTES = 256 * 1024
TRIMMED = "...[trimmed: the answer is capped at 256 KiB]"

# Verb -> the names of its arguments (for messages; the count is what is checked here).
VERBS: dict[str, tuple[str, ...]] = {
    "status": ("SERVER",),
    "evidence": ("SERVER",),
    "restart": ("SERVER",),
    "stop": ("SERVER",),
    "start": ("SERVER",),
    "guard-port": ("SERVER",),
    # A GPU is named by its `gpu` index and its PCI bus id: the node refuses a mismatch.
    "power-cap": ("GPU", "WATTS", "PCI_BUS_ID"),
    "power-cap-restore": ("GPU", "PCI_BUS_ID"),
}


class Refused(Exception):
    """A request that is not allowed: nothing was done; exit 2."""


class Failed(Exception):
    """An action was tried and did not succeed; exit 1. `result` says how far it got."""

    def __init__(self, message: str, result: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.result = result or {}


@dataclass(frozen=True)
class Request:
    """A validated verb and its arguments (tokens, not yet checked against the roster)."""

    verb: str
    args: tuple[str, ...]


@dataclass
class Reply:
    """The one JSON answer of a request, and its exit code."""

    verb: str
    args: list[str]
    host: str
    ok: bool = False
    result: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    exit_code: int = EXIT_REFUSED

    def to_json(self) -> str:
        """One line of JSON, at most `MAX_OUTPUT_BYTES` (large parts trimmed with a marker)."""
        return bounded_json(
            {
                "ok": self.ok,
                "verb": self.verb,
                "args": self.args,
                "host": self.host,
                "result": self.result,
                "error": self.error,
            }
        )


def show(text: str, limit: int = 200) -> str:
    """`text` for a log line: escaped like a Python literal (no newline survives), cut short."""
    shown = repr(text)
    return shown if len(shown) <= limit else shown[:limit] + "...'"


def parse_tokens(command: str | None) -> Request:
    """The request of an `SSH_ORIGINAL_COMMAND`; raises `Refused` naming what is wrong."""
    if command is None:
        raise Refused(
            "SSH_ORIGINAL_COMMAND is not set: --ssh is meant as the forced command of an "
            "authorized_keys entry, which sshd runs with the client's command in it"
        )
    if not command:
        raise Refused("the command is empty")
    if len(command) > MAX_COMMAND_CHARS:
        raise Refused(f"the command is longer than {MAX_COMMAND_CHARS} characters")
    tokens = command.split(" ")
    if len(tokens) > MAX_TOKENS:
        raise Refused(f"{len(tokens)} words; at most {MAX_TOKENS} are accepted")
    return check_tokens(tokens)


def check_tokens(tokens: list[str]) -> Request:
    """A request from a verb and its arguments; raises `Refused` for any bad token or count."""
    for position, token in enumerate(tokens, start=1):
        if not TOKEN.fullmatch(token):
            what = "is empty (two spaces in a row?)" if not token else f"{show(token)} is not"
            raise Refused(
                f"word {position} {what} "
                + ("" if not token else "a plain name ")
                + "(allowed: letters, digits and . _ @ : - after a letter or digit, "
                "at most 128 characters)"
            )
    verb, args = tokens[0], tuple(tokens[1:])
    names = VERBS.get(verb)
    if names is None:
        raise Refused(f"unknown verb {show(verb)}; the verbs are: {', '.join(VERBS)}")
    if len(args) != len(names):
        usage = " ".join([verb, *names])
        raise Refused(f"{verb} takes {len(names)} argument(s), got {len(args)}: usage: {usage}")
    return Request(verb, args)


def bounded_json(answer: dict[str, Any]) -> str:
    """`answer` as one JSON line of at most `MAX_OUTPUT_BYTES` bytes.

    Evidence can be large (journal lines, command lines): the biggest parts of the result are
    cut first, with a marker, so that the answer stays a whole JSON object.
    """
    text = json.dumps(answer, ensure_ascii=False, separators=(",", ":"))
    if len(text.encode()) <= MAX_OUTPUT_BYTES:
        return text
    result = dict(answer.get("result") or {})
    # Largest parts first, until it fits.
    for key in sorted(result, key=lambda k: -len(json.dumps(result[k], ensure_ascii=False))):
        result[key] = {"error": TRIMMED}
        answer = {**answer, "result": result}
        text = json.dumps(answer, ensure_ascii=False, separators=(",", ":"))
        if len(text.encode()) <= MAX_OUTPUT_BYTES:
            return text
    answer = {**answer, "result": {"error": TRIMMED}}
    return json.dumps(answer, ensure_ascii=False, separators=(",", ":"))
