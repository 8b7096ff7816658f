"""Checkpoint and KV objects in MooncakeStore (format in ``objects.py``)."""
