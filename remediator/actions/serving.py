r"""Actions that talk to the model server (and its proxy) over HTTP: drain, health, canary.

    - drain:                         # take the server out of routing and let it go idle
        max_wait_seconds: 60         # wait at most this long for busy slots (then go on)
        fail_if_busy: false          # true: a server still busy after the wait fails the step
        require_proxy: false         # true: a LiteLLM proxy that cannot be told fails the step
    - wait_healthy:                  # /health 200, then one small completion answered
        within_seconds: 180
    - canary_benchmark:              # is the throughput really down? (degradation playbook)
        n_predict: 64
        confirm_below_ratio: 0.7     # measured / 7-day baseline at or below this: confirmed

`drain`, when the roster gives the server a LiteLLM proxy (`litellm: {url, model_id,
admin_key_file}`), first takes the deployment out of routing (`POST {url}/model/block`
`{"model_id": …}` with the admin key as bearer token) and hands the engine an undo
(`litellm_unblock`: `POST {url}/model/unblock`), which the engine runs at the end of the run
whatever happened in between. Then it polls the server's `/slots` (llama-server) or
`/metrics` (vLLM `vllm:num_requests_running`) until nothing is processing, at most
`max_wait_seconds`: a runaway generation never ends by itself, so after the wait the playbook
goes on and the restart cuts it. A server that does not answer at all has nothing to drain.

`canary_benchmark` (llama-server only: it reads the answer's `timings.predicted_per_second`)
compares one fresh generation with the recording rule's 7-day baseline
(`server_model:gpufleet_tokens_per_second:baseline_7d` of the server's roster role and model).
As a step (`mode: confirm`) it ends the run early as a *false alarm* (no restart; outcome
`done_unverified`, the verification text says "false alarm") when the speed is above
`confirm_below_ratio` of the baseline, and lets the next steps (drain, restart) run when the
drop is confirmed. As a verification probe (`mode: verify`) it holds only when the speed is
back above that ratio.
"""

from __future__ import annotations

import http.client
import json
import re
import socket
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Literal
from urllib.parse import quote

from pydantic import Field

from fleet.roster import Server
from remediator.actions.registry import (
    ActionContext,
    ActionParams,
    StepResult,
    Undo,
    action,
)
from remediator.prometheus_api import QueryError, build_opener, query_instant

_MAX_BODY = 1024 * 1024
_REQUEST_TIMEOUT_SECONDS = 10.0
_EXCERPT = 300
_RUNNING = re.compile(r"^vllm:num_requests_running(?:\{[^}]*\})?\s+([0-9.eE+-]+)", re.MULTILINE)


class HttpAnswer:
    """One HTTP exchange's result: a status and body, or the reason there was none.

    `sent` is False only when the request surely never reached the other side (the connection
    was refused, or no time was left to try): then nothing it asked for can have happened.
    """

    def __init__(
        self, status: int | None, body: bytes, error: str | None, *, sent: bool = True
    ) -> None:
        self.status = status
        self.body = body
        self.error = error
        self.sent = sent

    @property
    def maybe_applied(self) -> bool:
        """Whether a change asked for may have been made though no 2xx said so.

        No answer after sending (a timeout, a connection lost) and a 5xx (a gateway's 504 in
        front of a proxy that went on) are not definite: the change may stand. A 4xx is the
        other side refusing it.
        """
        if self.status is None:
            return self.sent
        return self.status >= 500

    def json(self) -> Any:
        """The body as JSON (None when it is not JSON)."""
        try:
            return json.loads(self.body.decode("utf-8"))
        except (UnicodeDecodeError, ValueError):
            return None

    def excerpt(self) -> str:
        """The start of the body, for a step output."""
        return self.body[:_EXCERPT].decode("utf-8", errors="replace")


def http_call(
    method: str,
    url: str,
    *,
    timeout: float,
    body: Any = None,
    bearer: str | None = None,
) -> HttpAnswer:
    """One request (JSON body if given), no proxies, no redirects; never raises."""
    headers = {"User-Agent": "gpu-fleet-remediator", "Accept": "application/json"}
    data = None
    if body is not None:
        data = json.dumps(body).encode()
        headers["Content-Type"] = "application/json"
    if bearer is not None:
        headers["Authorization"] = f"Bearer {bearer}"
    request = urllib.request.Request(url, method=method, data=data, headers=headers)
    if timeout <= 0:
        return HttpAnswer(None, b"", f"timeout: no time left for {method} {url}", sent=False)
    try:
        with build_opener().open(request, timeout=timeout) as response:
            return HttpAnswer(response.status, response.read(_MAX_BODY), None)
    except urllib.error.HTTPError as exc:
        try:
            content = exc.read(_MAX_BODY)
        except (OSError, http.client.HTTPException):
            content = b""
        finally:
            exc.close()
        return HttpAnswer(exc.code, content, None)
    except TimeoutError:
        return HttpAnswer(None, b"", f"timeout: {method} {url} after {timeout:.1f} s")
    except urllib.error.URLError as exc:
        reason = exc.reason
        if isinstance(reason, TimeoutError):
            return HttpAnswer(None, b"", f"timeout: {method} {url} after {timeout:.1f} s")
        text = reason.strerror if isinstance(reason, OSError) and reason.strerror else reason
        # Refused, or a name that does not resolve: the request never left.
        never_sent = isinstance(reason, ConnectionRefusedError | socket.gaierror)
        return HttpAnswer(None, b"", f"{method} {url}: {text}", sent=not never_sent)
    except (OSError, http.client.HTTPException) as exc:
        return HttpAnswer(None, b"", f"{method} {url}: {exc!r}")


def read_key(path: Path) -> str:
    """A key file's content (stripped); `OSError`/`ValueError` when unusable."""
    value = path.read_text(encoding="utf-8").strip()
    if not value or "\n" in value:
        raise ValueError(f"{path}: must hold one line (the key)")
    return value


def _server(ctx: ActionContext, what: str) -> Server | StepResult:
    entry = ctx.target.server_entry
    if entry is None:
        return StepResult(False, f"error: {what} acts on a server target, not {ctx.target.key}")
    return entry


def _server_key(entry: Server) -> str | None:
    return read_key(entry.api_key_file) if entry.api_key_file is not None else None


def _timeout(ctx: ActionContext) -> float:
    return min(_REQUEST_TIMEOUT_SECONDS, ctx.remaining())


# --- LiteLLM ---------------------------------------------------------------------------------


def _litellm(ctx: ActionContext, path: str) -> tuple[bool, str, bool]:
    """POST `{litellm.url}{path}` `{"model_id": …}` with the admin key.

    (ok, what happened, whether it may have been applied without a 200 saying so).
    """
    entry = ctx.target.server_entry
    proxy = entry.litellm if entry is not None else None
    if proxy is None:
        return False, "no LiteLLM proxy in the roster for this server", False
    try:
        key = read_key(proxy.admin_key_file)
    except (OSError, ValueError) as exc:
        return False, f"LiteLLM admin key unusable: {exc}", False
    url = proxy.url.rstrip("/") + path
    answer = http_call(
        "POST", url, timeout=_timeout(ctx), body={"model_id": proxy.model_id}, bearer=key
    )
    if answer.error is not None:
        return False, f"LiteLLM {path}: {answer.error}", answer.maybe_applied
    if answer.status != 200:
        what = f"LiteLLM {path} answered {answer.status}: {answer.excerpt()}"
        return False, what, answer.maybe_applied
    return True, f"LiteLLM {path} {proxy.model_id}: 200", False


@action("litellm_unblock", ActionParams, default_timeout_seconds=30.0)
def litellm_unblock(ctx: ActionContext, params: ActionParams) -> StepResult:
    """Put the server's deployment back into the LiteLLM proxy's routing (`/model/unblock`)."""
    ok, what, _ = _litellm(ctx, "/model/unblock")  # idempotent: safe to repeat
    return StepResult(ok, what)


# --- drain -----------------------------------------------------------------------------------


class DrainParams(ActionParams):
    """`drain`: how long to wait for idle slots, and what is fatal."""

    max_wait_seconds: float = Field(default=60.0, ge=0, le=3600)
    interval_seconds: float = Field(default=1.0, gt=0, le=60)
    fail_if_busy: bool = False
    require_proxy: bool = False
    unblock_timeout_seconds: float = Field(default=30.0, gt=0, le=300)

    def needs_seconds(self) -> float:
        """The wait, plus the proxy call and the last poll."""
        return self.max_wait_seconds + 2 * _REQUEST_TIMEOUT_SECONDS


def busy_slots(ctx: ActionContext, entry: Server) -> tuple[int | None, str]:
    """How many requests the server is processing (None: cannot tell), and how it was read."""
    key = _server_key(entry)
    if entry.engine == "vllm":
        answer = http_call("GET", f"{entry.url}/metrics", timeout=_timeout(ctx), bearer=key)
        if answer.error is not None or answer.status != 200:
            return None, answer.error or f"/metrics answered {answer.status}"
        found = _RUNNING.findall(answer.body.decode("utf-8", errors="replace"))
        if not found:
            return None, "/metrics has no vllm:num_requests_running"
        return round(sum(float(v) for v in found)), "vllm:num_requests_running"
    # /slots of a sleeping llama-server waits for it to wake (reloading its model) and resets
    # its idle timer: ask /props first, which answers from cache while it sleeps.
    asked = http_call("GET", f"{entry.url}/props", timeout=_timeout(ctx), bearer=key)
    if asked.error is not None:
        # No answer at all (refused, timed out: a frozen server): /slots, served by the same
        # HTTP threads, cannot answer either, and asking would cost the drain another
        # timeout per poll (the lab's SIGSTOPped server: 10 s each on /props and /slots).
        return None, f"/props: {asked.error}"
    props = asked.json()
    if isinstance(props, dict) and props.get("is_sleeping") is True:
        return 0, "/props: sleeping, nothing in flight (/slots not asked: it would wake it)"
    answer = http_call("GET", f"{entry.url}/slots", timeout=_timeout(ctx), bearer=key)
    if answer.error is not None:
        return None, answer.error
    if answer.status != 200:
        return None, f"/slots answered {answer.status}"
    slots = answer.json()
    if not isinstance(slots, list):
        return None, "/slots answered something that is not a list of slots"
    busy = sum(1 for slot in slots if isinstance(slot, dict) and slot.get("is_processing"))
    return busy, f"/slots ({len(slots)} slots)"


def _unblock_undo(ctx: ActionContext, params: DrainParams) -> Undo | None:
    """What drain will need undone: the server's deployment back into LiteLLM's routing."""
    entry = ctx.target.server_entry
    if entry is None or entry.litellm is None:
        return None
    return Undo(
        "litellm_unblock",
        ActionParams(),
        params.unblock_timeout_seconds,
        f"put {entry.litellm.model_id} back into LiteLLM's routing",
    )


@action(
    "drain",
    DrainParams,
    default_timeout_seconds=90.0,
    undo_first=_unblock_undo,
    undo="`litellm_unblock` (the deployment back into LiteLLM's routing), journaled before the "
    "block and run at the end of the run whatever happened after, or after a crash",
)
def drain(ctx: ActionContext, params: DrainParams) -> StepResult:
    """Take the server out of its proxy's routing (if any), then wait for idle slots.

    With a LiteLLM proxy in the roster (`litellm: {url, model_id, admin_key_file}`): `POST
    /model/block {"model_id"}` with the admin key; then waits until `/slots` shows no slot
    processing (vLLM: `vllm:num_requests_running` 0), at most `max_wait_seconds`, then goes on
    (a runaway request never finishes by itself: the restart cuts it). The unblock (`POST
    /model/unblock`) runs at the end of the run **whatever happened after** — a later step
    failing, the run timing out — journaled as an extra step `litellm_unblock`. A block
    without a definite answer (a timeout, a connection lost after sending, a 5xx) counts as
    applied: the unblock is owed all the same; only a 4xx or a refused connection owes none.
    """
    entry = _server(ctx, "drain")
    if isinstance(entry, StepResult):
        return entry
    lines: list[str] = []
    undo: Undo | None = None
    if entry.litellm is not None:
        blocked, what, maybe = _litellm(ctx, "/model/block")
        lines.append(what)
        if blocked or maybe:
            # No definite answer counts as applied, the conservative way: the unblock stays
            # owed (it is idempotent), or the deployment could stay out of routing for good.
            undo = _unblock_undo(ctx, params)
        if maybe:
            lines.append("the block may have been applied (no definite answer): unblock owed")
        if not blocked and params.require_proxy:
            return StepResult(False, "drain: " + "; ".join(lines), undo=undo)
    start = time.monotonic()
    wait_end = start + min(params.max_wait_seconds, max(0.0, ctx.remaining() - 1.0))
    busy, how = busy_slots(ctx, entry)
    while busy and time.monotonic() < wait_end:
        if ctx.cancel.wait(min(params.interval_seconds, max(0.0, wait_end - time.monotonic()))):
            lines.append("cancelled while waiting for idle slots")
            return StepResult(False, "\n".join(lines), undo=undo)
        busy, how = busy_slots(ctx, entry)
    waited = time.monotonic() - start
    if busy is None:
        lines.append(f"cannot see the server's load ({how}): nothing to wait for")
        ok = True
    elif busy == 0:
        lines.append(f"idle after {waited:.1f} s ({how})")
        ok = True
    else:
        lines.append(
            f"still {busy} request(s) processing after {waited:.1f} s ({how}); "
            + ("failing (fail_if_busy)" if params.fail_if_busy else "going on: they are cut")
        )
        ok = not params.fail_if_busy
    return StepResult(ok, "drain: " + "; ".join(lines), {"busy": busy}, undo=undo)


# --- wait_healthy ----------------------------------------------------------------------------


class WaitHealthyParams(ActionParams):
    """`wait_healthy`: how long the server has to become healthy and answer a completion."""

    within_seconds: float = Field(default=180.0, gt=0, le=3600)
    interval_seconds: float = Field(default=1.0, gt=0, le=60)
    completion: bool = True

    def needs_seconds(self) -> float:
        """The window, plus one completion's time limit."""
        return self.within_seconds + _REQUEST_TIMEOUT_SECONDS


def _completion(ctx: ActionContext, entry: Server, key: str | None) -> tuple[bool, str]:
    if entry.engine == "llama":
        answer = http_call(
            "POST",
            f"{entry.url}/completion",
            timeout=_timeout(ctx),
            body={"prompt": "ping", "n_predict": 1, "cache_prompt": False},
            bearer=key,
        )
        data = answer.json()
        ok = answer.status == 200 and isinstance(data, dict) and "content" in data
    else:
        models = http_call("GET", f"{entry.url}/v1/models", timeout=_timeout(ctx), bearer=key)
        listing = models.json()
        try:
            model = listing["data"][0]["id"]
        except (TypeError, KeyError, IndexError):
            return False, f"/v1/models gave no model ({models.error or models.status})"
        answer = http_call(
            "POST",
            f"{entry.url}/v1/completions",
            timeout=_timeout(ctx),
            body={"model": model, "prompt": "ping", "max_tokens": 1},
            bearer=key,
        )
        data = answer.json()
        ok = answer.status == 200 and isinstance(data, dict) and "choices" in data
    if ok:
        return True, "a 1-token completion was answered"
    return False, f"completion: {answer.error or f'{answer.status} {answer.excerpt()}'}"


@action("wait_healthy", WaitHealthyParams, default_timeout_seconds=200.0, read_only=True)
def wait_healthy(ctx: ActionContext, params: WaitHealthyParams) -> StepResult:
    """Wait until `/health` answers 200, then check that one tiny completion is answered.

    `/health` 200, then one 1-token completion answered (`POST /completion`, vLLM
    `/v1/completions`).
    """
    entry = _server(ctx, "wait_healthy")
    if isinstance(entry, StepResult):
        return entry
    key = _server_key(entry)
    start = time.monotonic()
    end = start + min(params.within_seconds, ctx.remaining())
    last = "not asked"
    while True:
        answer = http_call("GET", f"{entry.url}/health", timeout=_timeout(ctx))
        last = answer.error or f"/health answered {answer.status}"
        if answer.status == 200:
            if not params.completion:
                return StepResult(True, f"healthy after {time.monotonic() - start:.1f} s")
            ok, what = _completion(ctx, entry, key)
            if ok:
                return StepResult(True, f"healthy after {time.monotonic() - start:.1f} s; {what}")
            last = what
        left = end - time.monotonic()
        if left <= 0:
            return StepResult(
                False, f"not healthy within {params.within_seconds:g} s; last: {last}"
            )
        if ctx.cancel.wait(min(params.interval_seconds, left)):
            return StepResult(False, f"cancelled while waiting for health; last: {last}")


# --- canary_benchmark ------------------------------------------------------------------------


def _child_asleep(ctx: ActionContext, entry: Server, served: str) -> str | None:
    """Why a router's child must not be measured now (asleep, not loaded, unknown), or None.

    `/props?model=…&autoload=false` answers from the child without loading it; its
    `is_sleeping` is read as the exporter reads it (unknown counts as asleep: a wrong guess
    must not wake a sleeper).
    """
    query = f"?model={quote(served, safe='')}&autoload=false"
    answer = http_call("GET", f"{entry.url}/props{query}", timeout=_timeout(ctx),
                       bearer=_server_key(entry))  # fmt: skip
    if answer.status != 200:
        why = answer.error or f"/props answered {answer.status}"
        return f"model {served} is not loaded ({why})"
    data = answer.json()
    sleeping = data.get("is_sleeping") if isinstance(data, dict) else None
    if sleeping is False:
        return None
    return f"model {served} is asleep" if sleeping else f"model {served}: sleeping unknown"


class CanaryParams(ActionParams):
    """`canary_benchmark`: one measured generation compared with the 7-day baseline."""

    n_predict: int = Field(default=64, ge=8, le=4096)
    confirm_below_ratio: float = Field(default=0.7, gt=0, lt=1)
    # `confirm` (a step): a false alarm ends the run, a confirmed drop lets it go on.
    # `verify` (a verification probe): ok only when the speed is back above the ratio.
    mode: Literal["confirm", "verify"] = "confirm"
    # Default: the recording rule's 7-day baseline of this server (and its current model).
    baseline_query: str | None = Field(default=None, min_length=1, max_length=2000)
    timeout_seconds: float = Field(default=60.0, gt=0, le=600)

    def needs_seconds(self) -> float:
        """The generation's time limit plus the baseline query."""
        return self.timeout_seconds + 5.0


@action("canary_benchmark", CanaryParams, default_timeout_seconds=90.0, read_only=True)
def canary_benchmark(ctx: ActionContext, params: CanaryParams) -> StepResult:
    """Measure generation speed now; a false alarm ends the run, a confirmed drop goes on.

    One measured generation against `server_model:gpufleet_tokens_per_second:baseline_7d`; at
    or below the ratio the drop is confirmed and the run goes on; above it the run ends as a
    **false alarm** (nothing restarted). `mode: verify` as a probe: ok when the speed is back.
    For a router's child (the alert's `served_model`) it measures that child by name with
    `autoload=false` against the child's own baseline, and only while
    `/props?model=…&autoload=false` says it is awake: an asleep or unloaded child is not
    measured (the run ends, nothing restarted; as a probe: not verified).
    """
    entry = _server(ctx, "canary_benchmark")
    if isinstance(entry, StepResult):
        return entry
    if entry.engine != "llama":
        return StepResult(False, "canary_benchmark: needs llama-server's timings (engine llama)")
    # A router's child: measured on its own, by name, never loaded or woken (below).
    served = ctx.target.served_model
    # The series of the server's role and model now: after a model swap, the former model's
    # baseline lives on for 7 days beside the new one, and the first series could be either.
    # A router's child has its own series, named by `served_model` (its `model` is the id).
    which = f"served_model={json.dumps(served)}" if served else f"model={json.dumps(entry.model)}"
    if served:
        asleep = _child_asleep(ctx, entry, served)
        if asleep is not None and params.mode == "verify":
            # After a restart the child may not be loaded again: the speed is unknown, and
            # loading it to find out is not the canary's to do.
            return StepResult(False, f"not verified: {asleep} (a canary loads and wakes nothing)")
        if asleep is not None:
            # Not measured, and nothing to restart for it: the rules do not call a sleeping
            # or unloaded model degraded, so the alert is stale (or the child just unloaded).
            return StepResult(True, f"not measured: {asleep}; nothing is restarted",
                              finish=f"not measured: {asleep}")  # fmt: skip
    query = params.baseline_query or (
        "server_model:gpufleet_tokens_per_second:baseline_7d"
        f'{{host="{ctx.target.host}",server="{ctx.target.server}",'
        f"role={json.dumps(entry.role)},{which}}}"
    )
    try:
        series = query_instant(ctx.prometheus_url, query, timeout_seconds=min(5.0, ctx.remaining()))
    except QueryError as exc:
        return StepResult(False, f"no baseline: {exc}")
    try:
        baseline = float(series[0]["value"][1])
    except (IndexError, KeyError, TypeError, ValueError):
        return StepResult(False, f"no baseline: {query} returned no value")
    body: dict[str, object] = {
        "prompt": "Write a long story about a lighthouse keeper.",
        "n_predict": params.n_predict,
        "cache_prompt": False,
        "ignore_eos": True,
    }
    path = "/completion"
    if served:
        # The router forwards a POST by the body's `model`; `autoload=false` makes it refuse
        # (400 "model is not loaded") rather than load a child that unloaded meanwhile
        # (server-models.cpp, proxy_post and router_validate_model, in the pinned source).
        body["model"] = served
        path = "/completion?autoload=false"
    answer = http_call(
        "POST",
        f"{entry.url}{path}",
        timeout=min(params.timeout_seconds, ctx.remaining()),
        body=body,
        bearer=_server_key(entry),
    )
    data = answer.json()
    try:
        speed = float(data["timings"]["predicted_per_second"])
    except (TypeError, KeyError, ValueError):
        return StepResult(
            False, f"canary got no timings: {answer.error or f'{answer.status} {answer.excerpt()}'}"
        )
    ratio = speed / baseline if baseline > 0 else 0.0
    details = {"tokens_per_second": round(speed, 2), "baseline": baseline, "ratio": round(ratio, 3)}
    measured = f"{speed:.1f} tok/s against a baseline of {baseline:.1f} ({ratio:.0%})"
    if params.mode == "verify":
        recovered = ratio > params.confirm_below_ratio
        verdict = "recovered" if recovered else "still degraded"
        return StepResult(recovered, f"{verdict}: {measured}", details)
    if ratio <= params.confirm_below_ratio:
        return StepResult(True, f"degradation confirmed: {measured}", details)
    return StepResult(
        True,
        f"false alarm: {measured}, above {params.confirm_below_ratio:.0%}; nothing is restarted",
        details,
        finish=f"false alarm: the canary measured {measured}",
    )
