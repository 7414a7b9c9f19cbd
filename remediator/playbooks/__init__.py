"""Playbooks: YAML that maps alerts to targets, steps, verification and policy."""
