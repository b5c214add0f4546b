"""Discrete-event simulator of LLM-serving instances over a paged, tiered KV cache."""
