"""The config's `zulip` section: the keys reports need, checked at start-up by key path."""

from __future__ import annotations

from pathlib import Path

from remediator.config import load_config
from remediator.service import report_settings
from tests.test_remediator_config import MINIMAL, ZULIP_KEY, etc, problems, write

__all__ = ["etc"]  # the fixture, imported for its use below


def test_the_zulip_section_with_every_key(etc: Path) -> None:
    config = load_config(
        write(
            etc,
            MINIMAL + "zulip:\n"
            "  zuliprc: zuliprc\n"
            "  stream: agent-hub\n"
            "  topics: {gpu: alerts-gpu, pm2: alerts-pm2}\n"
            "  default_topic: alerts-other\n"
            "  escalate_to: [oncall@example.org, lead@example.org]\n"
            "  grafana_url: https://grafana.example.org/d/gpu-fleet/\n"
            "  alertmanager_url: https://alertmanager.example.org\n",
        )
    )
    settings = report_settings(config)
    assert settings is not None
    assert settings.escalate_to == ("oncall@example.org", "lead@example.org")
    assert settings.grafana_url == "https://grafana.example.org/d/gpu-fleet"  # no trailing /
    assert settings.topics == {"gpu": "alerts-gpu", "pm2": "alerts-pm2"}
    assert settings.default_topic == "alerts-other"


def test_bad_zulip_keys_are_named_by_their_path(etc: Path) -> None:
    found = problems(
        etc,
        MINIMAL + "zulip:\n"
        "  zuliprc: zuliprc\n"
        "  stream: agent-hub\n"
        "  escalate_to: [oncall, 'a@b.org, c@d.org']\n"
        "  grafana_url: grafana.example.org\n"
        "  alertmanager_url: https://user:pw@am.example.org\n",
    )
    assert found == [
        "zulip.escalate_to[0]: 'oncall' is not an e-mail address (one Zulip user per entry)",
        "zulip.escalate_to[1]: 'a@b.org, c@d.org' is not an e-mail address (one Zulip user "
        "per entry)",
        "zulip.grafana_url: must be an http:// or https:// URL with a host",
        "zulip.alertmanager_url: secrets come from files, never inline in YAML: no "
        "credentials in the URL",
    ]


def test_the_zuliprc_keeps_tls_verification_on(etc: Path) -> None:
    section = MINIMAL + "zulip: {zuliprc: zuliprc, stream: s}\n"
    zuliprc = etc / "zuliprc"
    zuliprc.write_text(
        f"[api]\nemail=bot@example.org\nkey={ZULIP_KEY}\nsite=http://zulip.example.org\n"
    )
    assert problems(etc, section) == [
        f"zulip.zuliprc: {zuliprc}: [api] site must be https:// (http:// only on loopback)"
    ]
    zuliprc.write_text(
        f"[api]\nemail=bot@example.org\nkey={ZULIP_KEY}\nsite=https://zulip.example.org\n"
        "insecure=true\n"
    )
    [problem] = problems(etc, section)
    assert problem.startswith(f"zulip.zuliprc: {zuliprc}: [api] insecure would turn TLS")
    assert ZULIP_KEY not in problem
    # Plain http on loopback (a local Zulip, the tests' stand-in) is fine.
    zuliprc.write_text(f"[api]\nemail=bot@example.org\nkey={ZULIP_KEY}\nsite=http://127.0.0.1:8\n")
    assert load_config(write(etc, section)).zulip is not None
