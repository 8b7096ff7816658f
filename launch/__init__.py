"""Launch code: the CLI, the local stack and its processes, the Ray actor classes.

Sits above ``services/`` (router, prefill, decode) and the core library
``hybridpd/``; neither imports it."""
