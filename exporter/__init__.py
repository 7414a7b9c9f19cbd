"""gpu-fleet's host side: the exporter, the node helper and the roster they share."""

__version__ = "0.1.0"
