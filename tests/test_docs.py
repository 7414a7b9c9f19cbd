"""The docs are the repository's own: generated pages current, every path they name real.

- The generated references (docs/metrics.md, docs/alerts.md, docs/actions.md) are exactly what
  docs/generate.py makes from the code now: a family, rule or action changed without
  `make docs` fails here.
- Every repository path a doc names, in backticks or as a link, exists (`exporter/roster.py`
  moved: a page that still names it fails), and so does every module a doc names by its dotted
  name (`fleet.roster`) and every `#anchor` a link points at.
- No doc links outside the repository: links are relative and stay inside it, and no page
  names the team's own notes beside it (`../shared/`), which users never have.
- Every key of the roster and of the remediator's config has its row: tests/test_docs_keys.py.
- The README stays a front page (about 250 lines); the manual lives in docs/.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from docs.generate import PAGES, stale_pages

REPO = Path(__file__).resolve().parent.parent

# The pages a user reads. CHANGELOG.md is history: it names where things used to be.
DOC_FILES = sorted(
    {
        REPO / "README.md",
        *(REPO / "docs").rglob("*.md"),
        REPO / "rules" / "README.md",
        REPO / "grafana" / "README.md",
        REPO / "systemd" / "README.md",
    }
)
# A backticked token names a repository path when its first component is one of these.
TOP_LEVEL = (
    "exporter",
    "remediator",
    "fleet",
    "rules",
    "grafana",
    "systemd",
    "docs",
    "examples",
    "bench",
    "tests",
    ".ci",
)
TOP_FILES = ("Makefile", "pyproject.toml", "README.md", "CHANGELOG.md")
# `fleet.yaml`, `remediator.yaml`, `/etc/gpu-fleet/fleet.token`: files, not modules.
FILE_SUFFIXES = {"yaml", "yml", "json", "token", "key", "password", "db", "md", "log", "txt"}

# A fence closes on a line of the same run of backticks or tildes (a sample report in a
# five-backtick fence holds three-backtick blocks of its own).
FENCE = re.compile(r"^(`{3,}|~{3,})[^\n]*$.*?^\1[ \t]*$", re.MULTILINE | re.DOTALL)
INLINE_CODE = re.compile(r"`([^`\n]+)`")
LINK = re.compile(r"(?<!!)\[[^\]\n]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)|!\[[^\]\n]*\]\(([^)\s]+)\)")
AUTOLINK = re.compile(r"<(https?://[^>\s]+)>")
BARE_URL = re.compile(r"\bhttps?://[^\s)>\]`|]+")
LOOPBACK = re.compile(r"^https?://(127\.\d+\.\d+\.\d+|localhost|\[::1\])(:\d+)?(/|$)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.MULTILINE)


def prose(text: str) -> str:
    """The text outside fenced code blocks (what a renderer turns into links)."""
    return FENCE.sub("", text)


def doc_id(path: Path) -> str:
    return str(path.relative_to(REPO))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"`|\*\*|\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found: set[str] = set()
    for heading in HEADING.findall(prose(path.read_text(encoding="utf-8"))):
        base = slug(heading)
        name, n = base, 1
        while name in found:  # GitHub numbers repeated headings: x, x-1, x-2
            name, n = f"{base}-{n}", n + 1
        found.add(name)
    return found


def path_tokens(text: str) -> Iterator[str]:
    """The backticked tokens of `text` that name a repository path."""
    for code in INLINE_CODE.findall(text):
        for word in code.split():
            token = word.split("::", 1)[0].rstrip(".,:;)")
            if any(ch in token for ch in "<>{}$=\"'"):
                continue  # a template (`docs/runbooks/<alert>.md`), not a path
            first = token.split("/", 1)[0]
            if (first in TOP_LEVEL and "/" in token) or token in TOP_FILES:
                yield token


def module_tokens(text: str) -> Iterator[str]:
    """The backticked dotted names of our own modules (`fleet.roster`, `exporter.http.X`)."""
    for code in INLINE_CODE.findall(text):
        for token in re.findall(
            r"(?<![\w/.-])(?:fleet|exporter|remediator)(?:\.[A-Za-z_]\w*)+", code
        ):
            if token.rpartition(".")[2] not in FILE_SUFFIXES:  # `fleet.yaml` is a file
                yield token


def module_exists(dotted: str) -> bool:
    """The longest prefix of `dotted` is one of our modules, and the rest is defined there."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        base = REPO.joinpath(*parts[:cut])
        for source in (base.with_suffix(".py"), base / "__init__.py"):
            if source.is_file():
                rest = parts[cut:]
                if not rest:
                    return True
                return re.search(rf"\b{re.escape(rest[0])}\b", source.read_text()) is not None
    return False


def test_the_generated_references_are_current() -> None:
    assert stale_pages() == [], "run `make docs` and commit what it wrote"


def test_the_drift_check_sees_a_change(tmp_path: Path) -> None:
    # A stale copy is reported, a current one is not: the check above can fail.
    for name, make in PAGES.items():
        (tmp_path / name).write_text(make(), encoding="utf-8")
    assert stale_pages(tmp_path) == []
    page = tmp_path / "metrics.md"
    page.write_text(page.read_text().replace("gpufleet_gpu_up", "gpufleet_gpu_upp", 1))
    (tmp_path / "actions.md").unlink()
    assert stale_pages(tmp_path) == ["metrics.md", "actions.md"]


def test_the_references_cover_what_the_code_knows() -> None:
    from exporter.collectors.catalogue import CATALOGUE
    from remediator.actions.registry import registered

    metrics = (REPO / "docs" / "metrics.md").read_text()
    assert all(f"| `{name}` |" in metrics for name in CATALOGUE)
    actions = (REPO / "docs" / "actions.md").read_text()
    ours = [name for name, a in registered().items() if a.fn.__module__.startswith("remediator.")]
    assert len(ours) > 10
    assert all(f"## {name}\n" in actions for name in ours)
    alerts = (REPO / "docs" / "alerts.md").read_text()
    for rule_file in (REPO / "rules").glob("*alerts.rules.yml"):
        for name in re.findall(r"^\s+- alert: (\w+)", rule_file.read_text(), re.MULTILINE):
            assert f"| `{name}` |" in alerts, name


@pytest.mark.parametrize("doc", DOC_FILES, ids=doc_id)
def test_every_repository_path_a_doc_names_exists(doc: Path) -> None:
    text = doc.read_text(encoding="utf-8")
    # A path is the repository's, or the doc's own folder's (rules/README.md's `tests/`).
    missing = sorted(
        {
            token
            for token in path_tokens(text)
            if not any(list(base.glob(token.rstrip("/"))) for base in (REPO, doc.parent))
        }
    )
    assert missing == [], f"{doc_id(doc)} names paths that do not exist"
    unknown = sorted({token for token in module_tokens(text) if not module_exists(token)})
    assert unknown == [], f"{doc_id(doc)} names modules that do not exist"


@pytest.mark.parametrize("doc", DOC_FILES, ids=doc_id)
def test_links_stay_inside_the_repository_and_resolve(doc: Path) -> None:
    text = prose(doc.read_text(encoding="utf-8"))
    problems: list[str] = []
    for match in LINK.finditer(text):
        target = match.group(1) or match.group(2)
        if target.startswith("#"):
            if target[1:] not in anchors(doc):
                problems.append(f"{target}: no such heading here")
            continue
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("/"):
            problems.append(f"{target}: links outside the repository")
            continue
        file_part, _, anchor = target.partition("#")
        resolved = (doc.parent / file_part).resolve()
        if not resolved.is_relative_to(REPO):
            problems.append(f"{target}: leaves the repository")
        elif not resolved.exists():
            problems.append(f"{target}: no such file")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            problems.append(f"{target}: no such heading in {file_part}")
    problems += [f"<{url}>: links outside the repository" for url in AUTOLINK.findall(text)]
    outside = INLINE_CODE.sub("", text)
    problems += [
        f"{url}: an address outside this machine in the prose"
        for url in BARE_URL.findall(outside)
        if not LOOPBACK.match(url)
    ]
    if "../shared" in doc.read_text(encoding="utf-8"):
        problems.append("../shared: the team's notes are not the user's")
    assert problems == [], f"{doc_id(doc)}"


def test_the_checks_catch_what_they_are_for(tmp_path: Path) -> None:
    # The path and link checks above cannot pass merely by seeing nothing.
    text = (
        "See `exporter/roster.py` and `fleet/roster.py`, `fleet.roster.Roster`, "
        "`fleet.roster.NoSuchThing`, `exporter.gpu_index`, `.run/reports/` and `rules/*.yml`, "
        "`examples/fleet.yaml`, `fleet.yaml` and `/etc/gpu-fleet/remediator.yaml`."
    )
    assert sorted(path_tokens(text)) == [
        "examples/fleet.yaml",
        "exporter/roster.py",
        "fleet/roster.py",
        "rules/*.yml",
    ]
    assert [t for t in module_tokens(text) if not module_exists(t)] == [
        "fleet.roster.NoSuchThing",
        "exporter.gpu_index",
    ]
    assert slug("The `make run` tour (five minutes)") == "the-make-run-tour-five-minutes"
    links = prose("[a](https://example.org) [b](../x.md)\n```\n[c](http://no)\n```\n")
    assert [m.group(1) for m in LINK.finditer(links)] == ["https://example.org", "../x.md"]


def test_the_readme_is_a_front_page() -> None:
    lines = (REPO / "README.md").read_text(encoding="utf-8").splitlines()
    assert 180 <= len(lines) <= 300, f"README.md has {len(lines)} lines: the manual is docs/"
    text = "\n".join(lines)
    for command in ("make run", "make test"):
        assert command in text
    for page in ("docs/roster.md", "docs/remediator-config.md", "docs/install.md"):
        assert f"]({page})" in text, f"the README links {page}"
