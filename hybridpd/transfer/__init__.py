"""Prefill -> decode handoff of KV, state and draft buffers over NIXL."""
