"""llmserve: a JAX research framework for fast LLM inference."""
