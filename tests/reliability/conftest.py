"""The reliability suite's frame: the session's figures, printed as one table at the end.

The tests here carry the `reliability` marker (`make reliability` runs them at full size,
`make test` at the short one: see `figures.py`). A run whose must-be-zero figures (losses,
duplicate actions, wrong actions) are not all 0 fails, whatever the tests asserted.
"""

from __future__ import annotations

import pytest

from tests.reliability.figures import SIZE, Figures

_FIGURES = pytest.StashKey[Figures]()


def pytest_configure(config: pytest.Config) -> None:
    config.stash[_FIGURES] = Figures()


@pytest.fixture(scope="session")
def figures(request: pytest.FixtureRequest) -> Figures:
    """The session's figures: `figures.add(suite, name, n)`, `figures.zero(suite, name, n)`."""
    return request.config.stash[_FIGURES]


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    figures = session.config.stash.get(_FIGURES, None)
    if figures is not None and figures.failures() and exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    figures = terminalreporter.config.stash.get(_FIGURES, None)
    if figures is None or not figures.counts:
        return
    terminalreporter.section(f"reliability figures ({SIZE} size)")
    terminalreporter.write_line(figures.table())
    for failure in figures.failures():
        terminalreporter.write_line(f"FAILED figure: {failure}", red=True)
