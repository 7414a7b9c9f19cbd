"""The roster: the example loads, every error names the file and the key path."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from fleet.roster import RosterError, load_roster, resolve_host_name

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "fleet.yaml"

MINIMAL = """
hosts:
  dioscuri:
    address: 192.0.2.10
    gpus:
      nvidia: {count: 2, compute_mode: exclusive_process}
    servers:
      alpha:
        engine: llama
        url: http://127.0.0.1:31001/
        unit: llama-server@alpha.service
        role: gpu-dense
        model: Gemma4-31B-QAT-Q4_K_M
        gpu: 1
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "fleet.yaml"
    path.write_text(textwrap.dedent(text))
    return path


def error_of(tmp_path: Path, text: str) -> str:
    path = write(tmp_path, text)
    with pytest.raises(RosterError) as info:
        load_roster(path)
    message = str(info.value)
    assert str(path) in message
    return message


def test_example_roster_is_valid_and_shaped_like_the_fleet() -> None:
    roster = load_roster(EXAMPLE)
    assert set(roster.hosts) == {"dioscuri", "comfy-dev", "theia", "llm-gpu", "ocu-llm", "amdpve"}
    theia = roster.hosts["theia"]
    assert theia.gpus.nvidia is not None
    assert theia.gpus.nvidia.compute_mode == "exclusive_process"
    assert theia.servers["zeta"].engine == "vllm"
    dioscuri = roster.hosts["dioscuri"]
    assert dioscuri.gpus.expected_pci_bus_ids() == ["0000:41:00.0", "0000:c1:00.0"]
    assert dioscuri.power_bounds(0, "0000:41:00.0") == dioscuri.power_cap_watts["0000:41:00.0"]
    amdpve = roster.hosts["amdpve"]
    assert amdpve.thermal_criticals() == {"k10temp/Tctl": 90.0}
    assert amdpve.gpus.amd is not None and amdpve.gpus.nvidia is None
    roles = {s.role for h in roster.hosts.values() for s in h.servers.values()}
    assert {"gpu-dense", "gpu-light", "strix-moe"} <= roles
    # Documentation ranges only (RFC 5737): never a user's real address.
    for host in roster.hosts.values():
        assert host.address.startswith(("192.0.2.", "198.51.100.", "203.0.113."))


def test_minimal_roster_defaults(tmp_path: Path) -> None:
    roster = load_roster(write(tmp_path, MINIMAL))
    host = roster.hosts["dioscuri"]
    assert host.exporter_port == 9445
    assert host.local is False
    server = host.servers["alpha"]
    assert server.url == "http://127.0.0.1:31001"  # trailing slash dropped
    assert server.timeout_seconds == 2.0
    assert server.api_key_file is None


@pytest.mark.parametrize(
    ("old", "new", "expected"),
    [
        ("engine: llama", "engine: ollama", "hosts.dioscuri.servers.alpha.engine: Input should be"),
        (
            "        role: gpu-dense\n",
            "",
            "hosts.dioscuri.servers.alpha.role: required key is missing",
        ),
        ("gpu: 1", "gpu: 1\n        gpus: 2", "hosts.dioscuri.servers.alpha.gpus: unknown key"),
        (
            "url: http://127.0.0.1:31001/",
            "url: ftp://x",
            "hosts.dioscuri.servers.alpha.url: must be",
        ),
        ("url: http://127.0.0.1:31001/", "url: http://h:99999", "servers.alpha.url: bad port"),
        ("unit: llama-server@alpha.service", "unit: 'x; rm -rf /'", "servers.alpha.unit:"),
        ("alpha:", "'al pha':", "hosts.dioscuri.servers.al pha.[key]: String should match"),
        ("count: 2,", "count: -1,", "hosts.dioscuri.gpus.nvidia.count: Input should be greater"),
        ("compute_mode: exclusive_process", "compute_mode: shared", "nvidia.compute_mode:"),
        ("gpu: 1", "gpu: 2", "servers.alpha.gpu: 2 is not among the host's 2 GPU(s)"),
        ("address: 192.0.2.10", "address: 'not a host!'", "hosts.dioscuri.address: must be"),
        (
            "gpu: 1",
            "gpu: 1\n        timeout_seconds: 0",
            "servers.alpha.timeout_seconds: Input should be greater than 0",
        ),
        (
            "gpu: 1",
            "gpu: 1\n        api_key_file: relative.key",
            "api_key_file: must be an absolute",
        ),
    ],
)
def test_errors_name_the_key_path(tmp_path: Path, old: str, new: str, expected: str) -> None:
    assert old in MINIMAL
    message = error_of(tmp_path, MINIMAL.replace(old, new, 1))
    assert expected in message, message


def test_every_error_is_reported_at_once(tmp_path: Path) -> None:
    text = MINIMAL.replace("engine: llama", "engine: x").replace("role: gpu-dense", "rol: y")
    message = error_of(tmp_path, text)
    lines = message.splitlines()
    assert any("servers.alpha.engine" in line for line in lines)
    assert any("servers.alpha.role: required key is missing" in line for line in lines)
    assert any("servers.alpha.rol: unknown key" in line for line in lines)


def test_duplicate_keys_are_refused(tmp_path: Path) -> None:
    text = MINIMAL + textwrap.indent(
        textwrap.dedent(
            """\
            alpha:
              engine: vllm
              url: http://127.0.0.1:31002
              unit: vllm@alpha.service
              role: r
              model: m
            """
        ),
        "      ",
    )
    message = error_of(tmp_path, text)
    assert "duplicate key 'alpha'" in message


def test_two_servers_on_one_address_are_refused(tmp_path: Path) -> None:
    text = MINIMAL + textwrap.indent(
        "beta:\n  engine: llama\n  url: http://127.0.0.1:31001\n"
        "  unit: llama-server@beta.service\n  role: r\n  model: m\n",
        "      ",
    )
    message = error_of(tmp_path, text)
    assert "servers 'alpha' and 'beta' share the address" in message


def test_power_and_thermal_sections(tmp_path: Path) -> None:
    base = MINIMAL.replace(
        "    servers:", "    power_cap_watts: {0: {min: 300, max: 250}}\n    servers:"
    )
    assert "power_cap_watts.0: min (300.0) is above max (250.0)" in error_of(tmp_path, base)
    base = MINIMAL.replace(
        "    servers:", "    power_cap_watts: {5: {min: 1, max: 2}}\n    servers:"
    )
    assert "power_cap_watts.5: the host has 2 GPU(s)" in error_of(tmp_path, base)
    base = MINIMAL.replace(
        "    servers:", "    thermal: {Tctl: {critical_celsius: 90}}\n    servers:"
    )
    assert "thermal: key 'Tctl' must be 'chip/sensor'" in error_of(tmp_path, base)
    base = MINIMAL.replace(
        "nvidia: {count: 2, compute_mode: exclusive_process}",
        "amd: {count: 1, compute_mode: default}",
    )
    assert "compute modes exist only for NVIDIA GPUs" in error_of(tmp_path, base)


def test_gpus_by_pci_bus_id(tmp_path: Path) -> None:
    listed = MINIMAL.replace(
        "nvidia: {count: 2, compute_mode: exclusive_process}",
        "nvidia: {count: 2, pci_bus_ids: ['0000:C1:00.0', '41:00.0']}\n"
        "      amd: {count: 1, pci_bus_ids: ['0000:c5:00.0']}",
    ).replace(
        "    servers:",
        "    power_cap_watts: {'0000:41:00.0': {min: 300, max: 600}, 1: {min: 250, max: 450}}\n"
        "    servers:",
    )
    host = load_roster(write(tmp_path, listed)).hosts["dioscuri"]
    # Normalised to the sysfs form and sorted: the order the `gpu` numbering follows.
    assert host.gpus.expected_pci_bus_ids() == ["0000:41:00.0", "0000:c1:00.0", "0000:c5:00.0"]
    by_bus = host.power_bounds(0, "00000000:41:00.0")  # NVML's spelling finds it too
    assert by_bus is not None and (by_bus.min, by_bus.max) == (300, 600)
    by_index = host.power_bounds(1, "0000:c1:00.0")  # no bus-id key for it: the index's
    assert by_index is not None and by_index.max == 450
    assert host.power_bounds(2, "0000:c5:00.0") is None

    cases = [
        ("'41:00.0']", "'41:00.0', '0000:42:00.0']", "nvidia: pci_bus_ids: lists 3 GPU(s), count"),
        ("'41:00.0']", "'c1:00.0']", "pci_bus_ids: a PCI bus id is listed twice"),
        ("'41:00.0']", "'41:00']", "nvidia.pci_bus_ids: item 1: '41:00' is not a PCI bus id"),
        ("['0000:c5:00.0']", "['0000:c1:00.0']", "0000:c1:00.0: listed for nvidia and amd"),
        ("'0000:41:00.0': {", "'0000:42:00.0': {", "power_cap_watts.0000:42:00.0: not among"),
        ("'0000:41:00.0': {", "gpu0: {", "power_cap_watts: key 'gpu0' is neither a `gpu` index"),
        ("'0000:41:00.0': {", "'41:00.0': {min: 1, max: 2}, '0000:41:00.0': {", "given twice"),
        # Unquoted, YAML 1.1 reads a bus id as a base-60 number: say so instead of "not a string".
        ("'0000:41:00.0': {", "0000:41:00.0: {", "2460.0 is a number: quote PCI bus ids"),
        ("'41:00.0']", "41:00.0]", "nvidia.pci_bus_ids: item 1: 2460.0 is a number: quote"),
    ]
    for old, new, expected in cases:
        assert old in listed
        message = error_of(tmp_path, listed.replace(old, new, 1))
        assert expected in message, message


def test_not_yaml_and_not_a_mapping(tmp_path: Path) -> None:
    assert "not valid YAML" in error_of(tmp_path, "hosts: [unclosed\n")
    assert "(top level): must be a mapping" in error_of(tmp_path, "- a\n- b\n")
    assert "hosts: required key is missing" in error_of(tmp_path, "{}\n")
    missing = tmp_path / "nope.yaml"
    with pytest.raises(RosterError, match=r"nope\.yaml: cannot read"):
        load_roster(missing)


def test_host_resolution_order(tmp_path: Path) -> None:
    roster = load_roster(write(tmp_path, MINIMAL))
    host_file = tmp_path / "host"
    no_file = tmp_path / "absent"
    # --host wins, and must exist.
    assert (
        resolve_host_name(roster, "dioscuri", host_file=no_file, hostname=lambda: "x") == "dioscuri"
    )
    with pytest.raises(RosterError, match=r"--host 'theia': no such host"):
        resolve_host_name(roster, "theia", host_file=no_file, hostname=lambda: "dioscuri")
    # Then /etc/gpu-fleet/host.
    host_file.write_text("dioscuri\n")
    assert resolve_host_name(roster, None, host_file=host_file, hostname=lambda: "x") == "dioscuri"
    host_file.write_text("theia\n")
    with pytest.raises(RosterError, match="names host 'theia'"):
        resolve_host_name(roster, None, host_file=host_file, hostname=lambda: "dioscuri")
    # Then the hostname, full or its first label.
    assert (
        resolve_host_name(roster, None, host_file=no_file, hostname=lambda: "dioscuri")
        == "dioscuri"
    )
    assert (
        resolve_host_name(roster, None, host_file=no_file, hostname=lambda: "dioscuri.lan")
        == "dioscuri"
    )
    with pytest.raises(RosterError, match="cannot tell which roster host this is"):
        resolve_host_name(roster, None, host_file=no_file, hostname=lambda: "elsewhere")


LITELLM = """
        litellm:
          url: https://litellm.example.net:4000/
          model_id: 2f1c5e0a-alpha
          admin_key_file: /etc/gpu-fleet/litellm.key
"""


def test_litellm_keys_of_a_server(tmp_path: Path) -> None:
    roster = load_roster(write(tmp_path, MINIMAL.rstrip("\n") + LITELLM))
    litellm = roster.hosts["dioscuri"].servers["alpha"].litellm
    assert litellm is not None
    assert litellm.url == "https://litellm.example.net:4000"  # trailing slash dropped
    assert litellm.model_id == "2f1c5e0a-alpha"
    assert litellm.admin_key_file == Path("/etc/gpu-fleet/litellm.key")
    assert load_roster(write(tmp_path, MINIMAL)).hosts["dioscuri"].servers["alpha"].litellm is None


@pytest.mark.parametrize(
    ("old", "new", "expected"),
    [
        (
            "https://litellm.example.net:4000/",
            "ftp://litellm.example.net",
            "servers.alpha.litellm.url: must be an http:// or https:// URL with a host",
        ),
        (
            "/etc/gpu-fleet/litellm.key",
            "litellm.key",
            "servers.alpha.litellm.admin_key_file: must be an absolute path",
        ),
        ("2f1c5e0a-alpha", "'two words'", "servers.alpha.litellm.model_id: String should match"),
        ("model_id: 2f1c5e0a-alpha", "model: x", "servers.alpha.litellm.model: unknown key"),
    ],
)
def test_litellm_errors_name_the_key_path(
    tmp_path: Path, old: str, new: str, expected: str
) -> None:
    text = (MINIMAL.rstrip("\n") + LITELLM).replace(old, new)
    assert f"hosts.dioscuri.{expected}" in error_of(tmp_path, text)


def test_litellm_model_id_is_required(tmp_path: Path) -> None:
    text = (MINIMAL.rstrip("\n") + LITELLM).replace("          model_id: 2f1c5e0a-alpha\n", "")
    message = error_of(tmp_path, text)
    assert "hosts.dioscuri.servers.alpha.litellm.model_id: required key is missing" in message
