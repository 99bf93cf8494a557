"""Profiling a rank: torch.profiler sessions, their export and trace joining, the StartProfile /
StopProfile handlers, and the per-phase timing of decode steps."""
