"""What every executor shares: the request check, the bounded child process, the answer.

An executor runs one `gpu-fleet-node` verb for one roster host and turns what came back into a
`NodeAnswer`. The node's protocol (exporter/node/, docs/node.md):

- the request is a verb and at most three arguments, each a *token*
  (`^[A-Za-z0-9][A-Za-z0-9._@:-]{0,127}$`): they come from the roster-resolved target (a
  server's name, a GPU index, watts computed here), never from an alert's labels, and are
  checked again here before any process starts, so a bug upstream cannot become a command;
- the node prints exactly one JSON object on stdout,
  `{"ok": bool, "verb": str, "args": [str], "host": str, "result": {...}, "error": str|null}`,
  and exits 0 (done), 1 (tried and failed) or 2 (refused); the OpenSSH client exits 255 when
  the connection, the authentication or the host key fails.

Children never see a shell: argv lists only, stdin closed, a process group of their own so a
timeout or a cancel kills the whole tree (ssh and anything it started). Output is bounded:
at most `STDOUT_LIMIT` bytes of stdout and `STDERR_LIMIT` of stderr are kept; a child that
writes more is killed, because the protocol's answer is small and a flood is a fault.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import selectors
import signal
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

TOKEN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._@:-]{0,127}$")
MAX_WORDS = 4  # the verb and at most three arguments (the node refuses more)
VERBS = frozenset(
    {
        "status",
        "evidence",
        "restart",
        "stop",
        "start",
        "guard-port",
        "power-cap",
        "power-cap-restore",
    }
)
STDOUT_LIMIT = 1024 * 1024
STDERR_LIMIT = 64 * 1024
# How long a child gets between SIGTERM and SIGKILL when it must stop (timeout, cancel).
_TERM_GRACE_SECONDS = 1.0
_READ_CHUNK = 65536
# How much of stderr a failure message quotes (the tail: ssh and Python put the reason last).
_STDERR_QUOTE = 400

EXIT_DONE = 0
EXIT_FAILED = 1
EXIT_REFUSED = 2
EXIT_SSH = 255


class NodeRequestError(ValueError):
    """A request that must not be sent: unknown verb, too many words, a word not a token."""


def check_request(verb: str, args: Sequence[str]) -> list[str]:
    """`[verb, *args]` after checking each word; raises `NodeRequestError` with the reason.

    The node checks the same things again (the host trusts nobody); checking here as well
    means a request that would be refused never leaves the remediator.
    """
    if verb not in VERBS:
        raise NodeRequestError(f"unknown verb {verb!r} (known: {', '.join(sorted(VERBS))})")
    words = [verb, *args]
    if len(words) > MAX_WORDS:
        raise NodeRequestError(f"{len(words)} words: a request has at most {MAX_WORDS}")
    for word in words:
        if not isinstance(word, str) or not TOKEN.fullmatch(word):
            shown = repr(word)[:80]
            raise NodeRequestError(f"{shown} is not a plain token (letters, digits, ._@:-)")
    return words


@dataclass(frozen=True)
class ChildRun:
    """What a bounded child process did: exit code (None: killed by us) and its output."""

    exit_code: int | None
    stdout: bytes
    stderr: bytes
    seconds: float
    timed_out: bool = False
    cancelled: bool = False
    overflow: str | None = None  # "stdout" / "stderr": the child wrote more than allowed
    start_error: str | None = None  # the program could not be started (ENOENT, EACCES)


def _stop_group(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM the child's process group, SIGKILL it after a grace period; reap the child."""
    for sig, wait in ((signal.SIGTERM, _TERM_GRACE_SECONDS), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            break
        try:
            process.wait(wait)
            break
        except subprocess.TimeoutExpired:
            continue
    # The group leader may be gone while a grandchild still holds the group: kill the rest.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    if process.poll() is None:
        process.wait(5.0)


def run_bounded(
    argv: Sequence[str],
    *,
    timeout: float,
    cancel: threading.Event | None = None,
    env: Mapping[str, str] | None = None,
    stdout_limit: int = STDOUT_LIMIT,
    stderr_limit: int = STDERR_LIMIT,
) -> ChildRun:
    """Run `argv` (no shell) for at most `timeout` seconds, keeping bounded output.

    Never raises for the child's sake: a program that cannot start, a timeout, a cancel and an
    output flood all come back in the `ChildRun`.
    """
    start = time.monotonic()
    deadline = start + max(0.0, timeout)
    try:
        process = subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,  # its own process group: killpg reaches ssh's children too
            close_fds=True,
            env=dict(env) if env is not None else None,
        )
    except OSError as exc:
        return ChildRun(
            None, b"", b"", time.monotonic() - start,
            start_error=f"cannot start {argv[0]}: {exc.strerror or exc}",
        )  # fmt: skip
    assert process.stdout is not None and process.stderr is not None
    buffers = {process.stdout: bytearray(), process.stderr: bytearray()}
    limits = {process.stdout: stdout_limit, process.stderr: stderr_limit}
    names = {process.stdout: "stdout", process.stderr: "stderr"}
    timed_out = cancelled = False
    overflow: str | None = None
    with selectors.DefaultSelector() as selector:
        for stream in buffers:
            os.set_blocking(stream.fileno(), False)
            selector.register(stream, selectors.EVENT_READ)
        while selector.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                timed_out = True
                break
            if cancel is not None and cancel.is_set():
                cancelled = True
                break
            # Wake at least every 0.2 s to notice a cancel.
            for key, _ in selector.select(min(left, 0.2)):
                stream = process.stdout if key.fileobj is process.stdout else process.stderr
                try:
                    chunk = os.read(stream.fileno(), _READ_CHUNK)
                except BlockingIOError:
                    continue
                if not chunk:
                    selector.unregister(stream)
                    continue
                buffer = buffers[stream]
                room = limits[stream] - len(buffer)
                buffer.extend(chunk[: max(0, room)])
                if len(chunk) > room:
                    overflow = names[stream]
            if overflow is not None:
                break
    if timed_out or cancelled or overflow is not None:
        _stop_group(process)
    else:
        try:
            process.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            # Both pipes closed but the child lingers (it closed its stdout early): it is
            # still bound by the deadline.
            timed_out = True
            _stop_group(process)
    process.stdout.close()
    process.stderr.close()
    killed = timed_out or cancelled or overflow is not None
    return ChildRun(
        exit_code=None if killed else process.returncode,
        stdout=bytes(buffers[process.stdout]),
        stderr=bytes(buffers[process.stderr]),
        seconds=time.monotonic() - start,
        timed_out=timed_out,
        cancelled=cancelled,
        overflow=overflow,
    )


@dataclass(frozen=True)
class NodeAnswer:
    """The outcome of one node request, mapped to what a step needs.

    `ok` only for exit 0 with the node's JSON saying `"ok": true`. `summary` is one line for
    the step output; `result` is the node's `result` object (empty when there is none);
    `journal_text()` is what the step output keeps (summary, the command, bounded output).
    """

    ok: bool
    summary: str
    command: tuple[str, ...]
    exit_code: int | None
    seconds: float
    result: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    stdout: str = ""
    stderr: str = ""
    refused: bool = False
    timed_out: bool = False

    def journal_text(self, *, with_stdout: bool = True) -> str:
        """Summary, command and output for the journal (the journal bounds it again)."""
        lines = [self.summary, f"command: {' '.join(self.command)}"]
        lines.append(
            f"exit: {self.exit_code if self.exit_code is not None else 'killed'}, "
            f"{self.seconds:.2f} s"
        )
        if with_stdout and self.stdout:
            lines.append("stdout: " + self.stdout)
        if self.stderr.strip():
            lines.append("stderr: " + self.stderr.strip())
        return "\n".join(lines)


def _tail(data: bytes, limit: int = _STDERR_QUOTE) -> str:
    text = data.decode("utf-8", errors="replace").strip()
    return ("…" + text[-limit:]) if len(text) > limit else text


def _last_line(data: bytes) -> str:
    lines = [line for line in data.decode("utf-8", errors="replace").splitlines() if line.strip()]
    return lines[-1].strip()[:_STDERR_QUOTE] if lines else ""


def _parse_answer(stdout: bytes) -> dict[str, Any] | None:
    try:
        answer = json.loads(stdout.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return None
    return answer if isinstance(answer, dict) else None


def interpret(
    child: ChildRun, command: Sequence[str], *, what: str, timeout: float, via_ssh: bool
) -> NodeAnswer:
    """Map a finished child to a `NodeAnswer` (exit codes per the protocol, see the module)."""
    common: dict[str, Any] = {
        "command": tuple(command),
        "exit_code": child.exit_code,
        "seconds": child.seconds,
        "stdout": child.stdout.decode("utf-8", errors="replace"),
        "stderr": _tail(child.stderr, STDERR_LIMIT),
    }
    if child.start_error is not None:
        return NodeAnswer(False, f"{what}: {child.start_error}", **common)
    if child.timed_out:
        return NodeAnswer(
            False, f"timeout: {what} did not finish within {timeout:.1f} s (killed)",
            timed_out=True, **common,
        )  # fmt: skip
    if child.cancelled:
        return NodeAnswer(False, f"cancelled: {what} was stopped (the run was cancelled)", **common)
    if child.overflow is not None:
        limit = STDOUT_LIMIT if child.overflow == "stdout" else STDERR_LIMIT
        return NodeAnswer(
            False,
            f"{what}: wrote more than {limit} bytes to {child.overflow}; killed (the node's "
            "answer is one small JSON object)",
            **common,
        )
    code = child.exit_code
    if via_ssh and code == EXIT_SSH:
        reason = _last_line(child.stderr) or "no message"
        return NodeAnswer(False, f"ssh: {reason}", **common)
    answer = _parse_answer(child.stdout)
    if answer is None:
        reason = _last_line(child.stderr) or "no message on stderr"
        return NodeAnswer(
            False, f"{what}: exit {code} without the node's JSON answer ({reason})", **common
        )
    raw_result = answer.get("result")
    result = raw_result if isinstance(raw_result, dict) else {}
    raw_error = answer.get("error")
    error = str(raw_error) if raw_error not in (None, "") else None
    if code == EXIT_DONE and answer.get("ok") is True:
        return NodeAnswer(True, f"{what}: done", result=result, **common)
    if code == EXIT_REFUSED:
        return NodeAnswer(
            False,
            f"refused by the host: {error or _last_line(child.stderr) or 'no reason given'}",
            result=result, error=error, refused=True, **common,
        )  # fmt: skip
    if code == EXIT_FAILED:
        return NodeAnswer(
            False, f"{what} failed: {error or 'no reason given'}", result=result, error=error,
            **common,
        )  # fmt: skip
    return NodeAnswer(
        False,
        f"{what}: unexpected exit {code} (ok={answer.get('ok')!r}): {error or 'no reason given'}",
        result=result,
        error=error,
        **common,
    )


class NodeExecutor(Protocol):
    """Runs `gpu-fleet-node VERB ARGS…` for one roster host."""

    host: str

    def command(self, verb: str, args: Sequence[str]) -> list[str]:
        """The argv that would run the request (checked words; raises `NodeRequestError`)."""
        ...

    def run(
        self,
        verb: str,
        args: Sequence[str],
        *,
        timeout: float,
        cancel: threading.Event | None = None,
    ) -> NodeAnswer:
        """Run the request, bounded by `timeout`; never raises for the node's sake."""
        ...


def run_request(
    executor: NodeExecutor,
    verb: str,
    args: Sequence[str],
    *,
    timeout: float,
    cancel: threading.Event | None,
    env: Mapping[str, str] | None,
    via_ssh: bool,
) -> NodeAnswer:
    """The shared body of `NodeExecutor.run`: check, build, run bounded, interpret."""
    what = f"{verb} {' '.join(args)} on {executor.host}".replace("  ", " ")
    try:
        argv = executor.command(verb, args)
    except NodeRequestError as exc:
        return NodeAnswer(False, f"not sent: {exc}", (), None, 0.0, refused=True)
    child = run_bounded(argv, timeout=timeout, cancel=cancel, env=env)
    return interpret(child, argv, what=what, timeout=timeout, via_ssh=via_ssh)
