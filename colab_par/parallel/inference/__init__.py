"""The parallel model's forward-only uses: generation with a KV cache (and each sampled token's
log-probability), sampling, the weights gathered once per generate call, held-out evaluation."""
