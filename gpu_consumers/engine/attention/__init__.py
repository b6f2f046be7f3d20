"""Paged attention: the per-step metadata, prefill attention and the decode backends."""
