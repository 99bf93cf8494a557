"""The admin ops at a rank: the handler of every control message, by domain, and the one owner
of admission (quiesce)."""
