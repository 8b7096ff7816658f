"""Benchmarks behind `hybridpd bench ...` (results: JSON + PNG + markdown)."""
