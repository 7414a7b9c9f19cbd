"""Zulip Markdown that alert text cannot break, and trimming a report to the server's limit.

Alert labels and annotations come from whoever writes the rules, and step output from the
hosts: none of it may change the shape of a report. So, in Zulip's Markdown
(https://zulip.com/help/format-your-message-using-markdown):

- `inline(text)`: one line (newlines become spaces, so no list, quote or fence can start),
  the punctuation of inline markup backslash-escaped (no link, image, emphasis or code; a
  leading `#`, `>`, `-`, `+` or `1.` too: no heading, quote or list), `<` as the entity
  `&lt;` (no `<time:…>` stamp, no HTML), and a zero-width space after `@`, inside `$$` and
  `~~` (no mention — wildcard `@**all**` included —, no math, no strike-through);
- `cell(text)`: `inline`, and `|` escaped, which ends a table cell otherwise;
- `code(text)`: a code span whose backtick run is longer than any inside the text;
- `evidence_block(title, text)`: a spoiler holding a code block, both fenced with more
  backticks than any run inside, so no line of the evidence can close either.

`fit(content, limit)` makes a report fit Zulip's `max_message_length` by cutting the evidence
block's inside (head and tail kept), never the header, the steps or the outcome around it.
"""

from __future__ import annotations

import re

# Characters that make markup anywhere in a line (emphasis, code, links, images, mentions):
# each is in Python-Markdown's ESCAPED_CHARS, so a backslash before it shows the character.
_ESCAPED = re.compile(r"([\\`*_\[\]])")
# And at the start of a line: a heading, a quote, a list item.
_BLOCK_START = re.compile(r"^(?:([#>+-])|(\d+)([.)]))")
_BACKTICKS = re.compile(r"`+")
_EVIDENCE_OPEN = re.compile(r"^(`{4,})spoiler (.*)$")
ZERO_WIDTH_SPACE = "\u200b"

CUT_MARK = "… [{cut} characters cut to fit Zulip's message limit] …"


def one_line(text: str) -> str:
    """`text` on one line: every run of whitespace (newlines included) becomes one space."""
    return " ".join(text.split())


def inline(text: str) -> str:
    """Plain text for a line of Markdown: shown as written, never interpreted."""
    return escape(one_line(text))


def escape(text: str) -> str:
    """`inline` without the whitespace clean-up (for a piece of a line; no newline in it)."""
    escaped = _ESCAPED.sub(r"\\\1", text.replace("\n", " ")).replace("<", "&lt;")
    escaped = _BLOCK_START.sub(lambda m: f"\\{m[1]}" if m[1] else f"{m[2]}\\{m[3]}", escaped)
    for pair in ("@", "$$", "~~"):
        escaped = escaped.replace(pair, pair[0] + ZERO_WIDTH_SPACE + pair[1:])
    return escaped


def cell(text: str) -> str:
    """Text for a table cell: `inline`, with the cell separator `|` escaped."""
    return inline(text).replace("|", "\\|") or " "


def cell_code(text: str) -> str:
    """A code span for a table cell; plain `cell` text if it holds a `|`.

    In GitHub-style tables a `|` splits the cell even inside a code span.
    """
    return cell(text) if "|" in text else code(text)


def code(text: str) -> str:
    """`text` as an inline code span, whatever backticks it holds."""
    text = one_line(text)
    longest = max((len(run) for run in _BACKTICKS.findall(text)), default=0)
    fence = "`" * (longest + 1)
    # A span that starts or ends with a backtick needs a space inside the fence (CommonMark).
    pad = " " if text.startswith("`") or text.endswith("`") or not text else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def _fence_for(text: str) -> str:
    longest = max((len(run) for run in _BACKTICKS.findall(text)), default=0)
    return "`" * max(3, longest + 1)


def evidence_block(title: str, text: str) -> str:
    """A collapsed spoiler titled `title` holding `text` verbatim in a code block."""
    inner = _fence_for(text)
    outer = inner + "`"
    body = text.rstrip("\n")
    return f"{outer}spoiler {inline(title)}\n{inner}text\n{body}\n{inner}\n{outer}"


def _cut_middle(text: str, budget: int) -> str:
    """`text` in at most `budget` characters: its head and tail, the cut marked."""
    if len(text) <= budget:
        return text
    mark = CUT_MARK.format(cut=len(text))
    room = budget - len(mark) - 2
    if room <= 0:
        return ""
    head_len = room // 3  # the tail is usually where a command says why it failed
    tail_len = room - head_len
    cut = len(text) - head_len - tail_len
    mark = CUT_MARK.format(cut=cut)
    return f"{text[:head_len]}\n{mark}\n{text[len(text) - tail_len :]}"


def fit(content: str, limit: int) -> str:
    """`content` in at most `limit` characters (Unicode code points, as Zulip counts).

    The evidence block's inside is cut first (head and tail kept); if even an empty one is
    too long, the block is replaced by one line saying so. Only a report whose outcome alone
    exceeds the limit (a limit far below any real server's) is cut at the end, marked.
    """
    if len(content) <= limit:
        return content
    lines = content.split("\n")
    for start, line in enumerate(lines):
        opened = _EVIDENCE_OPEN.match(line)
        if opened is None:
            continue
        outer = opened.group(1)
        try:
            end = lines.index(outer, start + 1)
        except ValueError:
            break
        inner = outer[:-1]
        if end - start < 3 or lines[start + 1] != inner + "text" or lines[end - 1] != inner:
            break
        evidence = "\n".join(lines[start + 2 : end - 1])
        before = "\n".join(lines[: start + 2])
        after = "\n".join(lines[end - 1 :])
        budget = limit - len(before) - len(after) - 2
        kept = _cut_middle(evidence, budget) if budget > len(CUT_MARK) + 40 else ""
        if kept:
            return f"{before}\n{kept}\n{after}"
        note = f"_(evidence left out: Zulip's message limit is {limit} characters)_"
        shorter = "\n".join([*lines[:start], note, *lines[end + 1 :]])
        if len(shorter) <= limit:
            return shorter
        content = shorter
        break
    marker = "\n… [cut]"
    return content[: max(0, limit - len(marker))] + marker


def fit_topic(topic: str, limit: int = 60) -> str:
    """A topic name in at most `limit` characters (Zulip's `max_topic_length`), cut with `…`."""
    topic = one_line(topic)
    return topic if len(topic) <= limit else topic[: limit - 1] + "…"
