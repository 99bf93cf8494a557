"""sglang_admin: an LLM scheduler worker with a complete gRPC admin surface."""

__version__ = "0.1.0"
