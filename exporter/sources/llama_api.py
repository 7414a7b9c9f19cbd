"""llama-server's HTTP API: what its answers mean, parsed into plain values.

The meanings come from DESIGN.md's llama-server facts (checked on the pinned build):
- `/health` is answered by the HTTP threads: 200 ready, 503 while the model loads. It alone
  decides up or down. Refused means the process is gone; a timeout means it is hung.
- `/metrics` and `/slots` pass through the inference loop and can wait during a long prompt
  batch: a timeout there means *busy*, never dead. 501 means not enabled (`--metrics` missing,
  `--no-slots`).
- With `--api-key`, `/metrics`, `/slots` and `/props` need the key; `/health` never does.
- `tokens_predicted_total` moves only when a request finishes; progress while generating is
  `n_decode_total` and `/slots` `next_token[0].n_decoded`. Counters are printed with 6
  significant digits (`1.23457e+07`): above 1e8 `n_decode_total` moves in steps of 1000, so
  exact progress is `n_decoded` alone.
- Sleeping (`--sleep-idle-seconds`): `/health`, `/props` (`is_sleeping`) and `/metrics` answer
  from cache; `/slots` wakes the server. Router mode (`--models-dir`): `/props` says
  `role: "router"`, `/models` lists the children, per-model reads take `?model=NAME`.
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
from exporter.sources.scan import OverBudget, our_lines, plausible
from exporter.sources.text import clean_label


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
# Series of newer builds (speculative decoding, prompt cache, longest sequence): exported when
# present, never reported missing (an older build lacks them without any rename).
OPTIONAL_METRIC_NAMES: Mapping[str, str] = {
    "spec_drafts": "llamacpp:spec_decode_num_drafts_total",
    "spec_draft_tokens": "llamacpp:spec_decode_num_draft_tokens_total",
    "spec_accepted_tokens": "llamacpp:spec_decode_num_accepted_tokens_total",
    "prompt_tokens_cached": "llamacpp:prompt_tokens_cached_total",
    "tokens_max": "llamacpp:n_tokens_max",
}
# What `build_info` says when llama.cpp was built without its git metadata (a source package or
# tarball: cmake's `git describe` fails and common/build-info.cpp gets number 0, commit
# "unknown"). It names no version, so it is not exported.
UNKNOWN_BUILD = "b0-unknown"
MODEL_STATES = ("unloaded", "loading", "loaded", "sleeping", "failed")


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
    is_sleeping: bool | None = None  # None: this build does not say
    router: bool = False


@dataclass(frozen=True)
class RouterModel:
    """One model of a router's `/models`."""

    id: str
    state: str  # one of MODEL_STATES
    exit_code: int | None = None


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
    # bool is an int in Python; JSON true must not read as 1 slot. Python's JSON reads integers
    # of any length, llama-server writes 64-bit ones: a longer one is garbage, and one past a
    # float's range would make the exposition fail for the whole exporter (samples are floats).
    if isinstance(value, int) and not isinstance(value, bool) and -(2**63) <= value < 2**64:
        return value
    return None


def parse_props(body: bytes) -> Props:
    """Parse `/props`: `n_ctx` is per slot (`-c 65536 -np 2` gives 32768)."""
    data = _json(body)
    if not isinstance(data, dict):
        raise ParseError("/props is not a JSON object")
    settings = data.get("default_generation_settings")
    n_ctx = _int(settings.get("n_ctx")) if isinstance(settings, dict) else None
    alias = data.get("model_alias")
    build = data.get("build_info")
    sleeping = data.get("is_sleeping")
    router = data.get("role") == "router"
    return Props(
        # A router answers n_ctx 0: it has no context of its own (its children do).
        n_ctx_per_slot=None if router or not n_ctx else n_ctx,
        total_slots=_int(data.get("total_slots")),
        alias="" if router or not isinstance(alias, str) else clean_label(alias),
        build=clean_label(build) if isinstance(build, str) and build != UNKNOWN_BUILD else "",
        is_sleeping=sleeping if isinstance(sleeping, bool) else None,
        router=router,
    )


def parse_models(body: bytes) -> list[RouterModel]:
    """Parse a router's `GET /models`: each child's `status.value` (and its failed load)."""
    data = _json(body)
    entries = data.get("data") if isinstance(data, dict) else None
    if not isinstance(entries, list):
        raise ParseError("/models has no data list")
    models = []
    seen: set[str] = set()
    for entry in entries:
        if not isinstance(entry, dict) or not isinstance(entry.get("id"), str) or not entry["id"]:
            raise ParseError("/models entry without a string id")
        model_id = clean_label(entry["id"])
        if model_id in seen:
            # A model listed twice would be exported twice (a duplicate series): the first
            # entry stands. Compared once cleaned: two ids that differ only past the cap or in
            # unprintable characters would become one label value.
            continue
        seen.add(model_id)
        status = entry.get("status")
        status = status if isinstance(status, dict) else {}
        value = status.get("value")
        # server-models.cpp marks a child whose load failed with `failed: true` and its exit
        # code beside the value it fell back to (`unloaded`).
        failed = status.get("failed") is True
        state = "failed" if failed else value
        if state not in MODEL_STATES:
            raise ParseError(f"/models: {model_id}: unknown status {clean_label(repr(value))}")
        models.append(
            RouterModel(model_id, state, _int(status.get("exit_code")) if failed else None)
        )
    return models


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


METRICS_MAX_LINES = 2_000
"""The most `llamacpp:` lines a `/metrics` answer may have (today's builds write about 40)."""


def parse_metrics(body: bytes) -> tuple[dict[str, float], list[str]]:
    """Parse the `llamacpp:` lines of `/metrics` (`exporter.sources.scan`) with prometheus_client.

    Returns our keys (see `METRIC_NAMES`, `OPTIONAL_METRIC_NAMES`) to values, and the llamacpp:
    names that were expected but missing (an upstream rename). A value that is NaN, infinite,
    negative or past a float's range is left out: unknown, never exported (`scan.plausible`).
    """
    try:
        text = our_lines(body, "llamacpp:", max_lines=METRICS_MAX_LINES)
        samples = {
            sample.name: sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
        }
    except OverBudget as exc:
        raise ParseError(str(exc)) from None
    except ValueError as exc:  # UnicodeDecodeError is one too
        raise ParseError(f"unparsable exposition: {exc}") from None
    present = set(samples)  # an implausible value is unknown, not a renamed series
    samples = {name: value for name, value in samples.items() if plausible(value)}
    names = {**METRIC_NAMES, **OPTIONAL_METRIC_NAMES}
    values = {}
    for key, name in names.items():
        # The parser gives a counter's sample `_total` when its family name lacks it
        # (llama.cpp types `n_tokens_max` a counter): either spelling is the one series.
        for spelling in (name, f"{name}_total"):
            if spelling in samples:
                values[key] = samples[spelling]
                break
    missing = [name for name in METRIC_NAMES.values() if not {name, f"{name}_total"} & present]
    return values, missing
