"""llama-server's HTTP API: what its answers mean, parsed into plain values.

The meanings come from DESIGN.md's llama-server facts (checked on the pinned build):
- `/health` is answered by the HTTP threads: 200 ready, 503 while the model loads. It alone
  decides up or down. Refused means the process is gone; a timeout means it is hung.
- `/metrics` and `/slots` pass through the inference loop and can wait during a long prompt
  batch: a timeout there means *busy*, never dead. 501 means not enabled (`--metrics` missing,
  `--no-slots`).
- With `--api-key`, `/metrics`, `/slots` and `/props` need the key; `/health` never does.
- `tokens_predicted_total` moves only when a request finishes; progress while generating is
  `n_decode_total` and `/slots` `next_token[0].n_decoded`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from exporter.sources.http_client import Answer, Outcome


class Health(Enum):
    """The `state` label of `gpufleet_llama_health`."""

    OK = "ok"
    LOADING = "loading"
    ERROR = "error"
    UNREACHABLE = "unreachable"
    TIMEOUT = "timeout"


class EndpointState(Enum):
    """The `state` label of `gpufleet_llama_endpoint`."""

    OK = "ok"
    BUSY = "busy"  # timed out: the inference loop is busy (or the server is hung: see /health)
    DISABLED = "disabled"  # 501/404: the server was started without it
    ERROR = "error"  # refused, a bad status, an answer we cannot parse, a series gone missing


# The llamacpp: series our exports are made of. Their absence from an answer that otherwise
# parsed means an upstream rename: reported as an endpoint error, so alerts do not go quiet.
METRIC_NAMES: Mapping[str, str] = {
    "prompt_tokens": "llamacpp:prompt_tokens_total",
    "predicted_tokens": "llamacpp:tokens_predicted_total",
    "prompt_seconds": "llamacpp:prompt_seconds_total",
    "predicted_seconds": "llamacpp:tokens_predicted_seconds_total",
    "decode_calls": "llamacpp:n_decode_total",
    "requests_processing": "llamacpp:requests_processing",
    "requests_deferred": "llamacpp:requests_deferred",
}


def health_state(answer: Answer) -> Health:
    """What a `/health` answer says about the server."""
    if answer.outcome is Outcome.TIMEOUT:
        return Health.TIMEOUT
    if answer.outcome is Outcome.REFUSED:
        return Health.UNREACHABLE
    if answer.outcome is Outcome.ERROR:
        return Health.ERROR
    if answer.status == 200:
        return Health.OK
    if answer.status == 503:
        # llama-server answers 503 {"error": {"message": "Loading model"}} until it is ready.
        return Health.LOADING
    return Health.ERROR


def endpoint_state(answer: Answer) -> EndpointState:
    """The state of `/metrics`, `/slots` or `/props` from its raw answer (before parsing)."""
    if answer.outcome is Outcome.TIMEOUT:
        return EndpointState.BUSY
    if answer.outcome is not Outcome.ANSWERED:
        return EndpointState.ERROR
    if answer.status == 200:
        return EndpointState.OK
    if answer.status in (404, 501):
        return EndpointState.DISABLED
    return EndpointState.ERROR


class ParseError(ValueError):
    """An answer that does not have the shape this build of llama-server gives."""


@dataclass(frozen=True)
class Props:
    """What `/props` tells about the server."""

    n_ctx_per_slot: int | None
    total_slots: int | None
    alias: str
    build: str


@dataclass(frozen=True)
class Slot:
    """One slot of `/slots`."""

    id: int
    n_ctx: int | None
    busy: bool
    task_id: int | None
    decoded: int | None
    predict_limit: float | None  # n_predict; +Inf when the request has no cap (-1)


def _json(body: bytes) -> Any:
    try:
        return json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ParseError(f"not JSON: {exc}") from None


def _int(value: object) -> int | None:
    # bool is an int in Python; JSON true must not read as 1 slot.
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def parse_props(body: bytes) -> Props:
    """Parse `/props`: `n_ctx` is per slot (`-c 65536 -np 2` gives 32768)."""
    data = _json(body)
    if not isinstance(data, dict):
        raise ParseError("/props is not a JSON object")
    settings = data.get("default_generation_settings")
    n_ctx = _int(settings.get("n_ctx")) if isinstance(settings, dict) else None
    alias = data.get("model_alias")
    build = data.get("build_info")
    return Props(
        n_ctx_per_slot=n_ctx,
        total_slots=_int(data.get("total_slots")),
        alias=alias if isinstance(alias, str) else "",
        build=build if isinstance(build, str) else "",
    )


def parse_slots(body: bytes) -> list[Slot]:
    """Parse `/slots`: per slot whether it is processing, its task and its progress."""
    data = _json(body)
    if not isinstance(data, list):
        raise ParseError("/slots is not a JSON list")
    slots = []
    for entry in data:
        if not isinstance(entry, dict) or _int(entry.get("id")) is None:
            raise ParseError("/slots entry without an integer id")
        busy = entry.get("is_processing") is True
        decoded = None
        limit: float | None = None
        task_id = None
        if busy:
            task_id = _int(entry.get("id_task"))
            next_token = entry.get("next_token")
            if isinstance(next_token, list) and next_token and isinstance(next_token[0], dict):
                decoded = _int(next_token[0].get("n_decoded"))
            params = entry.get("params")
            n_predict = _int(params.get("n_predict")) if isinstance(params, dict) else None
            if n_predict is not None:
                # -1 is "no cap" (no -n and no max_tokens): the limit is infinite, not unknown.
                limit = math.inf if n_predict < 0 else float(n_predict)
        slots.append(
            Slot(
                id=entry["id"],
                n_ctx=_int(entry.get("n_ctx")),
                busy=busy,
                task_id=task_id,
                decoded=decoded,
                predict_limit=limit,
            )
        )
    return slots


def parse_metrics(body: bytes) -> tuple[dict[str, float], list[str]]:
    """Parse `/metrics` with prometheus_client's parser.

    Returns our keys (see `METRIC_NAMES`) to values, and the llamacpp: names that were
    expected but missing (an upstream rename).
    """
    try:
        text = body.decode("utf-8")
        samples = {
            sample.name: sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
        }
    except (ValueError, UnicodeDecodeError) as exc:
        raise ParseError(f"unparsable exposition: {exc}") from None
    values = {key: samples[name] for key, name in METRIC_NAMES.items() if name in samples}
    missing = [name for key, name in METRIC_NAMES.items() if key not in values]
    return values, missing
