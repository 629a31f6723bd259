"""Foundations every floor stands on: errors, times, escaping, fingerprints, the evidence database."""
