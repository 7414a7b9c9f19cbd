"""What gpu-fleet's two sides share: the host agent (`exporter/`) and the central remediator.

The roster (`fleet.roster`: the contract with the hosts, its models, loading and validation),
its strict YAML loader (`fleet.yamlfile`), GPU identity by PCI bus id (`fleet.gpu_index`), the
bounded HTTP front (`fleet.http_front`) and its web config (`fleet.webconfig`: TLS, basic auth,
headers). Both sides import this package; it imports neither (tests/test_import_graph.py).

Nothing is imported here on purpose: `gpu-fleet-node` runs as root and loads only the roster,
never the HTTP front or bcrypt (tests/test_node_imports.py).
"""
