"""Deployments, restarts and config changes (``kind = "changes"``)."""
