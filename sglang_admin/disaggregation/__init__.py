"""Prefill/decode disaggregation: bootstrap server, handshake, KV transfer backends and the
scheduler hooks of the prefill and decode roles (see docs/pd.md)."""
