"""Runnable tools of sglang_admin (benchmarks and helpers); run them as scripts."""
