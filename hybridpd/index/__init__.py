"""The global prefix index in Redis (schema in ``schema.py``)."""
