"""vLLM as the engine behind the prefill/decode actors (``engine: vllm``).

``args`` maps our config onto vLLM's engine arguments (no vLLM import, so it
is tested everywhere); ``core`` starts vLLM's ``LLMEngine`` in this process
(``environment`` sets the variables vLLM reads for that build only) and reads
it back, and ``engine`` drives it through the engine protocol; ``kv_events``
mirrors vLLM's KV-cache events into the Redis prefix index; ``tiny`` builds
the tiny random-weight Qwen3-Next the vLLM CPU tier runs. vLLM itself lives in
its own environment (``.venv-vllm``, made by ``scripts/bootstrap_vllm.sh``): its
pins differ from ours.
"""
