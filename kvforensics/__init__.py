"""kvforensics: investigate KV-cache cross-tenant exposure in LLM inference deployments."""

__version__ = "0.1.0"
