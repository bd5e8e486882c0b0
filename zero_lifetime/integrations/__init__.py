"""Integrations with training frameworks (imported on demand: each needs its framework)."""
