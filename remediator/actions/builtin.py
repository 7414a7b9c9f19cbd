r"""Actions that need no access to a host: `wait`, `prometheus_check`, `http_probe`.

All three are read-only (they observe and change nothing), so they also run under dry-run and
may serve as a playbook's verification probe. Importing this module registers them.

    - wait: {seconds: 30}                      # a grace period; returns early when cancelled
    - prometheus_check:                        # PromQL through Prometheus' HTTP API
        query: 'gpufleet_llama_up{host="{host}",server="{server}"} == 1'
        expect: nonempty                       # or `empty`
        within_seconds: 60                     # re-evaluated until then (0: once)
        interval_seconds: 5
    - http_probe:                              # one request, TLS verified, no redirects
        url: "{server.url}/health"
        method: GET                            # or POST (no body)
        expect_status: 200
        body_contains: '"status":"ok"'         # optional
        timeout_seconds: 5

Manual check of a probe: `curl -sS -o /dev/null -w '%{http_code}\n' URL`.
"""

from __future__ import annotations

import http.client
import ssl
import time
import urllib.error
import urllib.request
from typing import Literal
from urllib.parse import urlsplit

from pydantic import Field, field_validator

from remediator.actions.registry import ActionContext, ActionParams, StepResult, action
from remediator.prometheus_api import build_opener, promql_holds

# A health answer is small; reading more than this would only cost time and memory.
_MAX_PROBE_BODY = 1024 * 1024
# How much of an answer's body a step result quotes as evidence.
_EXCERPT_CHARS = 200
# prometheus_check: the time limit of one query, and what a step needs beyond its window.
_QUERY_TIMEOUT_SECONDS = 5.0


class WaitParams(ActionParams):
    """`wait`: how long."""

    seconds: float = Field(gt=0, le=3600)

    def needs_seconds(self) -> float:
        """The wait itself."""
        return self.seconds


@action("wait", WaitParams, default_timeout_seconds=60.0, read_only=True)
def wait(ctx: ActionContext, params: WaitParams) -> StepResult:
    """Wait `seconds`: a grace period (a unit restarting, a model loading)."""
    start = time.monotonic()
    allowed = min(params.seconds, ctx.remaining())
    if ctx.cancel.wait(allowed):
        waited = time.monotonic() - start
        return StepResult(False, f"cancelled after {waited:.1f} s of {params.seconds:g} s")
    if allowed < params.seconds:
        return StepResult(
            False,
            f"timeout: the step's time ran out after {allowed:.1f} s of a {params.seconds:g} s "
            "wait",
            {"timeout": True},
        )
    return StepResult(True, f"waited {params.seconds:g} s")


class PrometheusCheckParams(ActionParams):
    """`prometheus_check`: a PromQL query and what its result must be."""

    query: str = Field(min_length=1, max_length=4000)
    expect: Literal["nonempty", "empty"] = "nonempty"
    within_seconds: float = Field(default=0.0, ge=0, le=3600)
    interval_seconds: float = Field(default=5.0, gt=0, le=600)

    def needs_seconds(self) -> float:
        """The window, plus one query's time limit for the evaluation at its end."""
        return self.within_seconds + _QUERY_TIMEOUT_SECONDS


@action("prometheus_check", PrometheusCheckParams, default_timeout_seconds=30.0, read_only=True)
def prometheus_check(ctx: ActionContext, params: PrometheusCheckParams) -> StepResult:
    """Evaluate `query` until it is (non-)empty per `expect`, within the step's deadline.

    PromQL must (not) return series.
    """
    # The window shrinks to fit the deadline, leaving room for the last query to answer.
    within = min(params.within_seconds, max(0.0, ctx.remaining() - _QUERY_TIMEOUT_SECONDS))
    result = promql_holds(
        ctx.prometheus_url,
        params.query,
        within_seconds=within,
        interval_seconds=params.interval_seconds,
        cancel=ctx.cancel,
        timeout_seconds=min(_QUERY_TIMEOUT_SECONDS, max(0.2, ctx.remaining())),
        expect=params.expect,
    )
    return StepResult(
        result.ok,
        result.detail,
        {"query": params.query, "expect": params.expect, "samples": result.samples},
    )


class HttpProbeParams(ActionParams):
    """`http_probe`: one HTTP request and the answer it must get."""

    url: str = Field(max_length=2000)
    method: Literal["GET", "POST"] = "GET"
    expect_status: int = Field(default=200, ge=100, le=599)
    body_contains: str | None = Field(default=None, min_length=1)
    timeout_seconds: float = Field(default=5.0, gt=0, le=300)

    @field_validator("url")
    @classmethod
    def _http_url(cls, value: str) -> str:
        parts = urlsplit(value)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError("must be an http:// or https:// URL with a host")
        if parts.username is not None or parts.password is not None:
            raise ValueError("must not hold credentials (secrets come from files)")
        try:
            _ = parts.port
        except ValueError as exc:
            raise ValueError(f"bad port: {exc}") from None
        return value

    def needs_seconds(self) -> float:
        """The request's own time limit."""
        return self.timeout_seconds


@action("http_probe", HttpProbeParams, default_timeout_seconds=10.0, read_only=True)
def http_probe(ctx: ActionContext, params: HttpProbeParams) -> StepResult:
    """Send one request and compare the status (and optionally the body) with expectations.

    One request, no redirects.

    The request cannot be interrupted by `ctx.cancel`; its time limit, never more than the
    step has left, bounds it instead.
    """
    what = f"{params.method} {params.url}"
    timeout = min(params.timeout_seconds, ctx.remaining())
    if timeout <= 0:
        return StepResult(False, f"timeout: no time left for {what}", {"timeout": True})
    request = urllib.request.Request(
        params.url,
        method=params.method,
        data=b"" if params.method == "POST" else None,
        headers={"User-Agent": "gpu-fleet-remediator"},
    )
    start = time.monotonic()
    try:
        # urllib's default HTTPS context verifies the certificate and the host name.
        with build_opener().open(request, timeout=timeout) as response:
            status = response.status
            body = response.read(_MAX_PROBE_BODY)
    except urllib.error.HTTPError as exc:
        # A 4xx/5xx (or an unfollowed redirect) is an answer, to be compared like any other.
        status = exc.code
        try:
            body = exc.read(_MAX_PROBE_BODY)
        except (OSError, http.client.HTTPException):
            body = b""
        finally:
            exc.close()
    except TimeoutError:
        return _timed_out(what, timeout)
    except urllib.error.URLError as exc:
        if isinstance(exc.reason, TimeoutError):
            return _timed_out(what, timeout)
        reason = exc.reason
        if isinstance(reason, ssl.SSLCertVerificationError):
            return StepResult(
                False, f"{what}: TLS certificate not trusted: {reason.verify_message}"
            )
        if isinstance(reason, OSError) and reason.strerror:
            return StepResult(False, f"{what}: {reason.strerror.lower()}", {"error": str(reason)})
        return StepResult(False, f"{what}: {reason}", {"error": str(reason)})
    except (OSError, http.client.HTTPException) as exc:
        # The connection broke mid-answer (reset, a malformed status line).
        return StepResult(False, f"{what}: {exc!r}", {"error": repr(exc)})
    seconds = time.monotonic() - start
    text = body.decode("utf-8", errors="replace")
    details = {
        "status": status,
        "seconds": round(seconds, 3),
        "body_excerpt": text[:_EXCERPT_CHARS],
    }
    answered = f"{what} answered {status} in {seconds:.2f} s"
    if status != params.expect_status:
        return StepResult(False, f"{answered}, expected {params.expect_status}", details)
    if params.body_contains is not None and params.body_contains not in text:
        return StepResult(False, f"{answered}, body lacks {params.body_contains!r}", details)
    return StepResult(True, answered, details)


def _timed_out(what: str, timeout: float) -> StepResult:
    return StepResult(
        False, f"timeout: {what} did not answer within {timeout:.1f} s", {"timeout": True}
    )
