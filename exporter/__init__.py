"""gpu-fleet's host side: the exporter and the node helper (the roster is in `fleet`)."""

__version__ = "0.1.0"
