"""The parallel model's forward-only uses: generation with a KV cache (and each sampled token's
log-probability), sampling (one generator per call, or per row for rollouts), a rollout's rows
decoded by their data-parallel ranks and gathered, the weights gathered once per generate call,
held-out evaluation."""
