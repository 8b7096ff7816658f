"""hybridpd services: router, prefill and decode actors."""
