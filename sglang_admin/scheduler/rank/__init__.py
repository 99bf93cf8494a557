"""A scheduler rank as a process: its entry point, the loop around the batching policy and the
model, its heartbeat, and its lifetime tied to the server's."""
