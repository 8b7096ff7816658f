"""The native hybrid engine: gated-delta + attention layers, paged KV,
chunked prefill with internal checkpoints, prefix caching, EAGLE."""
