"""lmcache-mp: a long-lived KV-cache daemon for LLM serving."""

__version__ = "0.1.0"
