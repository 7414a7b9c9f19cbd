"""One collector per data source; `exporter.registry` registers them all on one registry."""
