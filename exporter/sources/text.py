r"""Strings from the network or from files, made fit to be label values where they are read.

A label value must encode as UTF-8 and should be short and printable. Python's JSON decoder
turns an escaped lone surrogate (`"\ud800"`) into a `str` that cannot be encoded at all, so one
server's `/props` could fail the whole exposition; control characters and megabyte aliases
are not failures but make series nobody can read or store. `clean_label` replaces what
cannot be shown with U+FFFD and cuts the rest at `LABEL_LIMIT` characters, ending with `…`.
"""

from __future__ import annotations

import re

LABEL_LIMIT = 256
"""The most characters a label value read from a source keeps (a model path fits easily)."""

# Surrogates (never valid in UTF-8) and the C0/C1 control characters, DEL included.
_UNFIT = re.compile("[\x00-\x1f\x7f-\x9f\ud800-\udfff]")
_REPLACEMENT = "\ufffd"


def clean_label(value: str, limit: int = LABEL_LIMIT) -> str:
    """`value` fit to be a label value: encodable, printable, at most `limit` characters."""
    # Most values (ids, models, chip names) are short ASCII: checked in C, returned as they are.
    if len(value) <= limit and value.isascii() and value.isprintable():
        return value
    cleaned = _UNFIT.sub(_REPLACEMENT, value)
    if len(cleaned) > limit:
        cleaned = cleaned[: limit - 1] + "…"
    return cleaned
