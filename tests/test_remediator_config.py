"""The remediator's config: defaults, every error at once by key path, secrets from files only.

Secret files are real files in tmp; credential checks run on real `Authorization` header
values. The constant-time comparison is observed by wrapping `hmac.compare_digest` with
pytest's monkeypatch (a recording stand-in that still compares), not a mock library.
"""

from __future__ import annotations

import base64
import hmac
import socket
import textwrap
from pathlib import Path

import pytest

from fleet.roster import DEFAULT_ROSTER_PATH
from remediator.config import (
    ConfigError,
    Credential,
    load_config,
    load_secrets,
    read_secret,
)

WEBHOOK_TOKEN = "webhook-token-0123456789abcdef"
ADMIN_TOKEN = "admin-token-fedcba9876543210"
ZULIP_KEY = "zulip-key-must-never-show-up"


@pytest.fixture
def etc(tmp_path: Path) -> Path:
    """A config directory with a roster and the usual secret files."""
    (tmp_path / "fleet.yaml").write_text("hosts: {}\n")
    (tmp_path / "webhook.token").write_text(WEBHOOK_TOKEN + "\n")
    (tmp_path / "admin.token").write_text(ADMIN_TOKEN + "\n")
    (tmp_path / "admin.password").write_text("correct horse battery staple\n")
    (tmp_path / "zuliprc").write_text(
        f"[api]\nemail=bot@zulip.example.org\nkey={ZULIP_KEY}\nsite=https://zulip.example.org\n"
    )
    (tmp_path / "playbooks").mkdir()
    return tmp_path


MINIMAL = """
roster: fleet.yaml
auth: {bearer_token_file: webhook.token}
admin: {bearer_token_file: admin.token}
"""


def write(directory: Path, text: str) -> Path:
    path = directory / "remediator.yaml"
    path.write_text(textwrap.dedent(text))
    return path


def problems(directory: Path, text: str) -> list[str]:
    path = write(directory, text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    lines = str(info.value).splitlines()
    prefix = f"{path}: "
    assert all(line.startswith(prefix) for line in lines), lines
    return [line.removeprefix(prefix) for line in lines]


def test_minimal_config_and_its_defaults(etc: Path) -> None:
    config = load_config(write(etc, MINIMAL))
    assert config.listen == "127.0.0.1:9095"
    assert config.listen_address() == ("127.0.0.1", 9095)
    assert config.journal == "sqlite:////var/lib/gpu-fleet/journal.db"
    assert config.prometheus_url == "http://127.0.0.1:9090"
    assert config.playbooks_dir is None and config.zulip is None
    assert config.dry_run is False
    assert config.replica_id == socket.gethostname()
    assert (config.workers, config.retention_days, config.lock_ttl_seconds) == (4, 30, 900)
    assert (config.limits.max_concurrent_runs, config.limits.max_runs_per_hour) == (4, 30)
    # Relative paths are the config file's directory's, whatever the working directory.
    assert config.roster == etc / "fleet.yaml"
    assert config.auth.bearer_token_file == etc / "webhook.token"


def test_full_config(etc: Path) -> None:
    config = load_config(
        write(
            etc,
            f"""
            listen: "[::1]:9999"
            roster: {etc / "fleet.yaml"}
            journal: postgresql://remediator@127.0.0.1/journal?passfile=/etc/gpu-fleet/pgpass
            auth: {{basic_auth: {{username: alertmanager, password_file: webhook.token}}}}
            admin: {{basic_auth: {{username: admin, password_file: admin.password}}}}
            prometheus_url: http://127.0.0.1:9091/
            playbooks_dir: playbooks
            dry_run: true
            zulip:
              zuliprc: zuliprc
              stream: agent-hub
              topics: {{gpu: alerts-gpu, inference: alerts-gpu, infra: alerts-infra}}
            replica_id: central-1
            workers: 8
            retention_days: 90
            limits: {{max_concurrent_runs: 2, max_runs_per_hour: 10}}
            lock_ttl_seconds: 600
            """,
        )
    )
    assert config.listen_address() == ("::1", 9999)
    assert config.prometheus_url == "http://127.0.0.1:9091"
    assert config.playbooks_dir == etc / "playbooks"
    assert config.zulip is not None and config.zulip.topics["infra"] == "alerts-infra"
    assert config.zulip.default_topic == "gpu-fleet"
    assert config.admin.basic_auth is not None and config.admin.basic_auth.username == "admin"
    assert (config.replica_id, config.workers, config.limits.max_runs_per_hour) == (
        "central-1", 8, 10,
    )  # fmt: skip


def test_every_problem_at_once_by_key_path(etc: Path) -> None:
    found = problems(
        etc,
        """
        listen: 9095
        roster: nowhere.yaml
        journal: mysql://remediator@127.0.0.1/journal
        auth:
          bearer_token_file: webhook.token
          basic_auth: {username: a, password_file: admin.password}
        prometheus_url: 127.0.0.1:9090
        playbooks_dir: missing-dir
        workers: 0
        limits: {max_concurrent_runs: 0, max_runs_per_hr: 5}
        zulip: {zuliprc: zuliprc, stream: "", topics: {gpu: alerts-gpu}}
        lock_ttl_seconds: 1
        retention: 30
        """,
    )
    assert found == [
        "listen: Input should be a valid string",
        f"roster: {etc / 'nowhere.yaml'}: no such file",
        "journal: backend 'mysql': the journal runs on sqlite or postgresql",
        "auth: give exactly one of bearer_token_file, basic_auth",
        "admin: required key is missing",
        "prometheus_url: must be an http:// or https:// URL with a host",
        f"playbooks_dir: {etc / 'missing-dir'}: no such directory",
        "zulip.stream: String should have at least 1 character",
        "workers: Input should be greater than or equal to 1",
        "limits.max_concurrent_runs: Input should be greater than or equal to 1",
        "limits.max_runs_per_hr: unknown key",
        "lock_ttl_seconds: Input should be greater than or equal to 10",
        "retention: unknown key",
    ]


def test_secrets_come_from_files_only(etc: Path) -> None:
    found = problems(
        etc,
        """
        roster: fleet.yaml
        auth: {token: hunter2}
        admin: {basic_auth: {username: admin, password: hunter2}}
        journal: postgresql://remediator:hunter2@127.0.0.1/journal
        zulip: {zuliprc: zuliprc, stream: s, api_key: hunter2}
        """,
    )
    assert found == [
        "journal: secrets come from files, never inline in YAML: drop the password from the URL "
        "and give libpq a passfile (`?passfile=/etc/gpu-fleet/pgpass` or ~/.pgpass)",
        "auth.token: secrets come from files, never inline in YAML: use bearer_token_file",
        "admin.basic_auth.password_file: required key is missing",
        "admin.basic_auth.password: secrets come from files, never inline in YAML: use "
        "password_file",
        "zulip.api_key: secrets come from files, never inline in YAML: use a *_file key",
    ]
    assert not any("hunter2" in line for line in found)


def test_secret_files_must_be_usable(etc: Path) -> None:
    (etc / "empty.token").write_text("  \n")
    (etc / "two-lines").write_text("one\ntwo\n")
    (etc / "spaced.token").write_text("not a token\n")
    found = problems(
        etc,
        """
        roster: fleet.yaml
        auth: {bearer_token_file: empty.token}
        admin: {bearer_token_file: missing.token}
        zulip: {zuliprc: playbooks, stream: s}
        """,
    )
    assert found == [
        f"auth.bearer_token_file: {etc / 'empty.token'}: is empty",
        f"admin.bearer_token_file: {etc / 'missing.token'}: no such file",
        f"zulip.zuliprc: {etc / 'playbooks'}: is a directory, not a file",
    ]
    found = problems(
        etc,
        """
        roster: fleet.yaml
        auth: {bearer_token_file: spaced.token}
        admin: {basic_auth: {username: "ad:min", password_file: two-lines}}
        ui: {username: " ui", password_file: two-lines}
        """,
    )
    assert found[0].startswith(
        f"auth.bearer_token_file: {etc / 'spaced.token'}: a bearer token may hold only"
    )
    assert found[1:] == [
        "admin.basic_auth.username: must not contain ':' or surrounding spaces",
        f"admin.basic_auth.password_file: {etc / 'two-lines'}: must hold one line (the "
        "secret), not several",
        "ui.username: must not contain ':' or surrounding spaces",
        f"ui.password_file: {etc / 'two-lines'}: must hold one line (the secret), not several",
    ]


def test_an_unreadable_secret_file(etc: Path) -> None:
    # Root reads any file whatever its mode (CI runs as root): a directory in the secret's
    # place cannot be read by anyone.
    (etc / "admin.token").unlink()
    (etc / "admin.token").mkdir()
    found = problems(etc, MINIMAL)
    assert found[0] == f"admin.bearer_token_file: {etc / 'admin.token'}: is a directory, not a file"


def test_zuliprc_is_checked_without_showing_the_key(etc: Path) -> None:
    (etc / "zuliprc").write_text(f"key={ZULIP_KEY}\n")
    found = problems(etc, MINIMAL + "zulip: {zuliprc: zuliprc, stream: s}\n")
    assert found == [f"zulip.zuliprc: {etc / 'zuliprc'}: not a zuliprc file (line 1): "
                     "expected an [api] section"]  # fmt: skip
    (etc / "zuliprc").write_text(f"[api]\nkey={ZULIP_KEY}\nsite=zulip.example.org\n")
    found = problems(etc, MINIMAL + "zulip: {zuliprc: zuliprc, stream: s}\n")
    assert found == [f"zulip.zuliprc: {etc / 'zuliprc'}: [api] lacks email"]
    assert not any(ZULIP_KEY in line for line in found)


def test_admin_secret_must_differ_from_the_webhook_secret(etc: Path) -> None:
    same_file = problems(
        etc,
        """
        roster: fleet.yaml
        auth: {bearer_token_file: webhook.token}
        admin: {bearer_token_file: webhook.token}
        """,
    )
    assert same_file == [
        f"admin: uses the same file as auth ({etc / 'webhook.token'}): the admin API needs "
        "its own secret, not Alertmanager's"
    ]
    (etc / "link.token").symlink_to(etc / "webhook.token")
    assert problems(
        etc,
        MINIMAL.replace(
            "admin: {bearer_token_file: admin.token}", "admin: {bearer_token_file: link.token}"
        ),
    )[0].startswith("admin: uses the same file as auth")
    # Another file, the same content; and a basic-auth password equal to the bearer token.
    (etc / "copy.token").write_text(WEBHOOK_TOKEN)
    for admin in (
        "{bearer_token_file: copy.token}",
        "{basic_auth: {username: admin, password_file: copy.token}}",
    ):
        found = problems(etc, f"roster: fleet.yaml\nauth: {{bearer_token_file: webhook.token}}\n"
                              f"admin: {admin}\n")  # fmt: skip
        assert found == [
            f"admin: its secret ({etc / 'copy.token'}) is the same as auth's "
            f"({etc / 'webhook.token'}): the admin API needs its own secret, not Alertmanager's"
        ]
        assert WEBHOOK_TOKEN not in found[0]


def test_files_that_are_not_configs(tmp_path: Path) -> None:
    missing = tmp_path / "missing.yaml"
    with pytest.raises(ConfigError, match=f"^{missing}: cannot read: No such file"):
        load_config(missing)
    assert problems(tmp_path, "auth: 1\nauth: 2\n") == [
        "not valid YAML (line 2, column 1): duplicate key 'auth' (line 2)"
    ]
    assert problems(tmp_path, "- listen\n") == ["(top level): must be a mapping of config keys"]
    # An empty file: every required key is named (and the default roster checked).
    found = problems(tmp_path, "")
    assert "auth: required key is missing" in found and "admin: required key is missing" in found
    if not DEFAULT_ROSTER_PATH.is_file():
        assert f"roster: {DEFAULT_ROSTER_PATH}: no such file" in found


# --- secrets and credentials ----------------------------------------------------------------


def basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


def test_bearer_credentials(etc: Path) -> None:
    secrets = load_secrets(load_config(write(etc, MINIMAL)))
    webhook, admin = secrets.webhook, secrets.admin
    assert webhook.scheme == "bearer" and webhook.www_authenticate.startswith("Bearer realm=")
    assert webhook.check_authorization_header(f"Bearer {WEBHOOK_TOKEN}")
    assert webhook.check_authorization_header(f"bearer  {WEBHOOK_TOKEN} ")
    assert not webhook.check_authorization_header(f"Bearer {ADMIN_TOKEN}")
    assert not webhook.check_authorization_header(f"Bearer {WEBHOOK_TOKEN}x")
    assert not webhook.check_authorization_header(f"Bearer {WEBHOOK_TOKEN[:-1]}")
    assert not webhook.check_authorization_header(None)
    assert not webhook.check_authorization_header("")
    assert not webhook.check_authorization_header("Bearer")
    assert not webhook.check_authorization_header(basic("x", WEBHOOK_TOKEN))
    assert not webhook.check_authorization_header(f"Token {WEBHOOK_TOKEN}")
    assert admin.check_authorization_header(f"Bearer {ADMIN_TOKEN}")
    assert not admin.check_authorization_header(f"Bearer {WEBHOOK_TOKEN}")
    # Never in a repr (logs, tracebacks).
    assert WEBHOOK_TOKEN not in repr(secrets) and ADMIN_TOKEN not in repr(secrets)


def test_basic_credentials(etc: Path) -> None:
    config = load_config(
        write(
            etc,
            MINIMAL.replace(
                "admin: {bearer_token_file: admin.token}",
                "admin: {basic_auth: {username: admin, password_file: admin.password}}",
            ),
        )
    )
    admin = load_secrets(config).admin
    assert admin.scheme == "basic" and admin.username == "admin"
    assert admin.www_authenticate.startswith("Basic realm=")
    assert admin.check_authorization_header(basic("admin", "correct horse battery staple"))
    assert not admin.check_authorization_header(basic("admin", "correct horse"))
    assert not admin.check_authorization_header(basic("root", "correct horse battery staple"))
    assert not admin.check_authorization_header("Basic not-base64!")
    assert not admin.check_authorization_header("Basic " + base64.b64encode(b"no colon").decode())
    assert not admin.check_authorization_header("Basic " + base64.b64encode(b"\xff:\xfe").decode())
    assert not admin.check_authorization_header("Bearer correct horse battery staple")
    assert "correct horse" not in repr(admin)


def test_secrets_are_compared_in_constant_time(etc: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def recording(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", recording)
    bearer = Credential("bearer", etc / "webhook.token", secret=WEBHOOK_TOKEN)
    assert bearer.check_authorization_header(f"Bearer {WEBHOOK_TOKEN}")
    assert not bearer.check_authorization_header("Bearer short")
    # Digests of equal length are compared, so not even the token's length leaks.
    assert len(calls) == 2 and all(len(a) == len(b) == 32 for a, b in calls)
    calls.clear()
    user = Credential("basic", etc / "admin.password", "admin", "pw")
    assert not user.check_authorization_header(basic("root", "pw"))
    # Both the user and the password are compared, whichever is wrong.
    assert len(calls) == 2


def test_read_secret(etc: Path) -> None:
    assert read_secret(etc / "webhook.token") == WEBHOOK_TOKEN
    (etc / "blank").write_text("\n\n")
    with pytest.raises(ConfigError, match="is empty"):
        read_secret(etc / "blank")
    with pytest.raises(ConfigError, match="no such file"):
        read_secret(etc / "nope")
    # A secret file that disappears after load_config: load_secrets says which.
    config = load_config(write(etc, MINIMAL))
    (etc / "admin.token").unlink()
    with pytest.raises(ConfigError, match=f"{etc / 'admin.token'}: no such file"):
        load_secrets(config)


def test_a_rotated_secret_file_is_read_again_and_the_old_secret_has_a_grace(etc: Path) -> None:
    now = [100.0]
    path = etc / "rotating.token"
    path.write_text("old-token-123\n")
    bearer = Credential("bearer", path, secret=read_secret(path), grace_seconds=60,
                        clock=lambda: now[0])  # fmt: skip
    assert bearer.check_authorization_header("Bearer old-token-123")
    assert not bearer.check_authorization_header("Bearer new-token-456")
    path.write_text("new-token-456\n")  # rotated: a new file content (and stamp)
    now[0] += 0.5
    # Looked at no more than once a second: not yet seen.
    assert not bearer.check_authorization_header("Bearer new-token-456")
    now[0] += 1.0
    assert bearer.check_authorization_header("Bearer new-token-456")
    assert bearer.check_authorization_header("Bearer old-token-123")  # within the grace
    now[0] += 61
    assert bearer.check_authorization_header("Bearer new-token-456")
    assert not bearer.check_authorization_header("Bearer old-token-123")  # grace over
    assert "new-token-456" not in repr(bearer)
    # A file that became empty (half-written) keeps the secret in force.
    path.write_text("")
    now[0] += 2
    assert bearer.check_authorization_header("Bearer new-token-456")


def test_a_bad_web_config_stops_the_start_naming_its_key(etc: Path) -> None:
    (etc / "web.yml").write_text("tls_server_config:\n  cert_file: nope.crt\n  key_fil: x\n")
    found = problems(etc, MINIMAL + "web_config_file: web.yml\n")
    assert found and all(line.startswith("web_config_file: ") for line in found), found
    assert any("key_fil" in line for line in found), found
    assert any("nope.crt" in line for line in found), found
