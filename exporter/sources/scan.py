"""Keep only our series' lines of a server's `/metrics` before any parser sees the text.

prometheus_client's text parser is pure Python, a few microseconds a line: an answer of half
a million junk series (a proxy's, a plugin's) took 13 to 18 s to parse, past Prometheus' scrape
timeout, and blanked the whole host. The series we read all share a prefix (`llamacpp:`,
`vllm:`), so a regular expression (C speed, about 10 ms for 8 MB) picks their samples and
their `# HELP`/`# TYPE` lines first; the parser then reads a few dozen lines. Past
`max_lines` of ours the answer is over budget: the endpoint reads `error` with that reason,
its neighbours untouched.

Also here: which values read from a server are numbers we can believe (`plausible`).
"""

from __future__ import annotations

import math
import re

from prometheus_client.parser import text_string_to_metric_families


class OverBudget(ValueError):
    """More lines of our prefix than the endpoint's budget allows."""


def _pattern(prefix: str) -> re.Pattern[bytes]:
    name = re.escape(prefix.encode())
    return re.compile(rb"^[ \t]*(?:#[ \t]+(?:HELP|TYPE)[ \t]+)?" + name + rb"[^\n]*", re.M)


_PATTERNS: dict[str, re.Pattern[bytes]] = {}


def our_lines(body: bytes, prefix: str, *, max_lines: int) -> str:
    """The lines of `body` about series named `prefix…`, as text for the parser.

    Raises `OverBudget` past `max_lines` such lines, `UnicodeDecodeError` (a `ValueError`)
    when they are not UTF-8.
    """
    pattern = _PATTERNS.get(prefix)
    if pattern is None:
        pattern = _PATTERNS[prefix] = _pattern(prefix)
    lines = pattern.findall(body)
    if len(lines) > max_lines:
        raise OverBudget(f"over budget: more than {max_lines} {prefix} lines")
    return b"\n".join(lines).decode("utf-8") + "\n"


HEAD_LINES = 200
"""How many lines `check_head` parses: enough to tell an exposition from an HTML error page."""


def check_head(body: bytes) -> None:
    """Raise `ValueError` when `body`'s first lines are not the text format (a proxy's page).

    For an answer with none of our lines: a valid exposition without them (vLLM started with
    `--disable-log-stats`) is not the same as a page that is no exposition at all.
    """
    head = b"\n".join(body.split(b"\n", HEAD_LINES)[:HEAD_LINES])
    for _ in text_string_to_metric_families(head.decode("utf-8") + "\n"):
        pass


def plausible(value: float) -> bool:
    """Whether a count or total read from a server can be believed: finite and not negative.

    Every llama.cpp and vLLM series we read counts something (tokens, requests, seconds,
    a ratio of used cache): NaN, ±Inf or a negative value is unknown, never exported (a
    `NaN` processing count would otherwise even read as "busy").
    """
    try:
        return math.isfinite(value) and value >= 0
    except OverflowError:  # an integer past a float's range
        return False
