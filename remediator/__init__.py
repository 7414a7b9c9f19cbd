"""gpu-fleet's central side: Alertmanager webhooks, playbooks, actions, reports."""
