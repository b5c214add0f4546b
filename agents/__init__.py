"""Learned agents (later issues)."""
