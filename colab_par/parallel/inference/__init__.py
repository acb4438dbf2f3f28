"""The parallel model's forward-only uses: generation with a KV cache, sampling, held-out evaluation."""
