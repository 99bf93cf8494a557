"""Tensor parallelism across the ranks of one replica (--tp-size > 1): the leader's runner, the
followers' loop, and the weight, memory and profile ops they run together."""
