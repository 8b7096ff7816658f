"""Benchmarks: each writes JSON (ratios against a same-run baseline) and a plot."""
