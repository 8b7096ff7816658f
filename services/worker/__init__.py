"""What the prefill and decode workers share: the engine loop, the worker base,
actor metrics and the typed messages between router and workers."""
