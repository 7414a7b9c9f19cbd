"""Prometheus' HTTP API client: instant and range queries, rules, and whether a fix held.

`promql_holds` evaluates an instant query (`GET /api/v1/query`, Prometheus docs "HTTP API")
until it returns a non-empty result or the time is up. The answer is

    {"status": "success", "data": {"resultType": "vector", "result": [{"metric": {...},
                                                                      "value": [ts, "1"]}]}}

and a query "holds" when `result` has at least one series: the usual alerting idiom, where a
comparison (`gpufleet_llama_up{...} == 1`) filters out the series that fail it. Used by the
`prometheus_check` action and by the engine's verification.

Network trouble never raises: Prometheus down, a timeout, an error answer (`{"status":
"error", "errorType": "bad_data", "error": "..."}`, HTTP 400/422/503) or a body that is not
the API's JSON all give `VerifyResult(ok=False, detail=<the reason>)`. With `expect="empty"`
the same is true: a failed query is never mistaken for an empty answer.

Manual check: `curl -G http://127.0.0.1:9090/api/v1/query --data-urlencode 'query=up == 1'`.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any, Literal

Expect = Literal["nonempty", "empty"]

# An instant query's answer for a fleet is small; a runaway query (a typo that selects every
# series) must not be read into memory whole.
_MAX_BODY_BYTES = 8 * 1024 * 1024
# Series quoted in a result's detail, as evidence for the journal and the report.
_EVIDENCE_SERIES = 3
# A query's own time limit is never below this, even when the window is nearly over.
_MIN_QUERY_TIMEOUT = 0.2


@dataclass(frozen=True)
class VerifyResult:
    """The verdict: `ok`, a one-line `detail` for humans, and the last answer's series count."""

    ok: bool
    detail: str
    samples: int


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """Redirects are reported as what they are, never followed to somewhere else."""

    def redirect_request(  # noqa: PLR0917 (urllib's signature)
        self,
        req: urllib.request.Request,
        fp: Any,
        code: int,
        msg: str,
        headers: Any,
        newurl: str,
    ) -> None:
        return None


def build_opener() -> urllib.request.OpenerDirector:
    """An opener without proxies and redirects, TLS verification on (urllib's default).

    Proxies from the environment are ignored: the remediator talks to its own Prometheus and
    its own fleet, and an `https_proxy` meant for something else must not see those requests.
    """
    return urllib.request.build_opener(urllib.request.ProxyHandler({}), _NoRedirect())


class QueryError(Exception):
    """A query that got no usable answer; the message says why (never raised out of here)."""


def _describe_series(series: Any) -> str:
    if not isinstance(series, dict):
        return repr(series)[:120]
    metric = series.get("metric") or {}
    labels = ",".join(f'{k}="{v}"' for k, v in sorted(metric.items()) if k != "__name__")
    name = metric.get("__name__", "")
    value = series.get("value")
    shown = value[1] if isinstance(value, list) and len(value) == 2 else "…"
    return f"{name}{{{labels}}} {shown}"


def query_instant(prometheus_url: str, query: str, *, timeout_seconds: float) -> list[Any]:
    """The series of an instant query's answer; raises `QueryError` with the reason."""
    data = _api_query(prometheus_url, "query", {"query": query}, timeout_seconds)
    result_type = data.get("resultType")
    if result_type not in ("vector", "matrix"):
        # A scalar or string always "has" a value: as a verdict it would always hold.
        raise QueryError(
            f"the query returns a {result_type}, not an instant vector; compare a vector "
            "instead (`… == 1`)"
        )
    result: list[Any] = data["result"]
    return result


def query_range(
    prometheus_url: str,
    query: str,
    *,
    start: float,
    end: float,
    step: float,
    timeout_seconds: float,
) -> list[Any]:
    """The series (`metric`, `values`) of a range query (Unix seconds); raises `QueryError`."""
    params = {
        "query": query,
        "start": f"{start:.3f}",
        "end": f"{end:.3f}",
        "step": f"{step:.3f}",
        "timeout": f"{timeout_seconds:g}s",
    }
    result: list[Any] = _api_query(prometheus_url, "query_range", params, timeout_seconds)["result"]
    return result


def alerting_rule_names(prometheus_url: str, *, timeout_seconds: float) -> set[str]:
    """The names of the alerting rules Prometheus evaluates (`/api/v1/rules?type=alert`)."""
    data = _api_get(prometheus_url, "rules", {"type": "alert"}, timeout_seconds)
    groups = data.get("groups")
    if not isinstance(groups, list):
        raise QueryError("Prometheus answered success without data.groups")
    names: set[str] = set()
    for group in groups:
        for rule in group.get("rules", []) if isinstance(group, dict) else []:
            if isinstance(rule, dict) and isinstance(rule.get("name"), str):
                names.add(rule["name"])
    return names


def loaded_config_yaml(prometheus_url: str, *, timeout_seconds: float) -> str:
    """The configuration Prometheus runs with, as YAML (`/api/v1/status/config`)."""
    data = _api_get(prometheus_url, "status/config", {}, timeout_seconds)
    text = data.get("yaml")
    if not isinstance(text, str):
        raise QueryError("Prometheus answered success without data.yaml")
    return text


def _api_query(
    prometheus_url: str, endpoint: str, params: dict[str, str], timeout_seconds: float
) -> dict[str, Any]:
    """`data` of a successful query answer (with `data.result`); raises `QueryError`."""
    data = _api_get(prometheus_url, endpoint, params, timeout_seconds)
    if not isinstance(data.get("result"), list):
        raise QueryError("Prometheus answered success without data.result")
    return data


def _api_get(
    prometheus_url: str, endpoint: str, params: dict[str, str], timeout_seconds: float
) -> dict[str, Any]:
    """`data` of a successful answer of `/api/v1/<endpoint>`; raises `QueryError` why not."""
    url = f"{prometheus_url.rstrip('/')}/api/v1/{endpoint}?{urllib.parse.urlencode(params)}"
    request = urllib.request.Request(url, headers={"Accept": "application/json"})
    try:
        with build_opener().open(request, timeout=timeout_seconds) as response:
            body = response.read(_MAX_BODY_BYTES + 1)
            status = response.status
    except urllib.error.HTTPError as exc:
        # 400 (bad_data), 422 (execution), 503 (timeout, canceled) carry the API's error JSON.
        status = exc.code
        try:
            body = exc.read(_MAX_BODY_BYTES + 1)
        except OSError:
            body = b""
        finally:
            exc.close()
    except TimeoutError:
        raise QueryError(
            f"Prometheus at {prometheus_url} did not answer within {timeout_seconds:.1f} s"
        ) from None
    except urllib.error.URLError as exc:
        reason = exc.reason
        if isinstance(reason, TimeoutError):
            raise QueryError(
                f"Prometheus at {prometheus_url} did not answer within {timeout_seconds:.1f} s"
            ) from None
        raise QueryError(f"Prometheus at {prometheus_url} is unreachable: {reason}") from None
    except (OSError, http.client.HTTPException) as exc:
        raise QueryError(f"Prometheus at {prometheus_url} failed: {exc!r}") from None
    if len(body) > _MAX_BODY_BYTES:
        raise QueryError(f"the answer is larger than {_MAX_BODY_BYTES} bytes")
    try:
        answer = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        raise QueryError(
            f"Prometheus answered HTTP {status} with a body that is not JSON: {body[:120]!r}"
        ) from None
    if not isinstance(answer, dict):
        raise QueryError(f"Prometheus answered HTTP {status} with unexpected JSON")
    if answer.get("status") != "success":
        kind = answer.get("errorType", "error")
        raise QueryError(
            f"Prometheus refused the query (HTTP {status}, {kind}): "
            f"{answer.get('error', 'no reason given')}"
        )
    data = answer.get("data")
    if not isinstance(data, dict):
        raise QueryError("Prometheus answered success without data")
    return data


def promql_holds(
    prometheus_url: str,
    query: str,
    *,
    within_seconds: float,
    interval_seconds: float,
    cancel: threading.Event | None = None,
    timeout_seconds: float = 5,
    expect: Expect = "nonempty",
) -> VerifyResult:
    """Evaluate `query` until its result is non-empty (or empty, per `expect`) or time is up.

    The first evaluation is immediate, then one every `interval_seconds` while the window of
    `within_seconds` lasts, the last at its end (0: once). Each query gets `timeout_seconds`,
    never more than the window has left. A set `cancel` ends the wait early (not ok, "cancelled").
    """
    start = time.monotonic()
    window_end = start + max(0.0, within_seconds)
    interval = max(0.05, interval_seconds)
    evaluations = 0
    last_detail = "not evaluated"
    samples = 0
    while True:
        left = window_end - time.monotonic()
        per_query = timeout_seconds if left <= 0 else min(timeout_seconds, left)
        evaluations += 1
        try:
            series = query_instant(
                prometheus_url, query, timeout_seconds=max(_MIN_QUERY_TIMEOUT, per_query)
            )
        except QueryError as exc:
            samples = 0
            last_detail = str(exc)
        else:
            samples = len(series)
            took = time.monotonic() - start
            if (samples > 0) == (expect == "nonempty"):
                evidence = "; ".join(_describe_series(s) for s in series[:_EVIDENCE_SERIES])
                if samples > _EVIDENCE_SERIES:
                    evidence += f"; … {samples - _EVIDENCE_SERIES} more"
                what = f"{samples} series: {evidence}" if samples else "no series, as expected"
                return VerifyResult(
                    True,
                    f"holds after {evaluations} evaluation(s) in {took:.1f} s: {what}",
                    samples,
                )
            last_detail = (
                "the query returned no series"
                if expect == "nonempty"
                else f"the query returned {samples} series, expected none: "
                + "; ".join(_describe_series(s) for s in series[:_EVIDENCE_SERIES])
            )
        # The last evaluation falls on the window's end, not an interval before it.
        pause = min(interval, window_end - time.monotonic())
        if pause <= 0:
            return VerifyResult(
                False,
                f"did not hold within {within_seconds:g} s ({evaluations} evaluation(s)); "
                f"last: {last_detail}",
                samples,
            )
        if cancel is not None:
            if cancel.wait(pause):
                return VerifyResult(
                    False,
                    f"cancelled after {evaluations} evaluation(s); last: {last_detail}",
                    samples,
                )
        else:
            time.sleep(pause)
