"""Prompts and outputs (``kind = "content"``), kept only as keyed fingerprints and prefix blocks."""
