"""A scheduler rank: its loop, batching policy, radix cache and the per-domain control handlers."""
