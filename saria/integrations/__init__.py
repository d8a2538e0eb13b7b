"""Engine integrations: ``saria.integrations.vllm`` (the vLLM KV connector)."""
