"""Engines: one protocol (``base.py``), a native PyTorch engine and vLLM."""
