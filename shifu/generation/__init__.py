"""Sampling from a policy: the fast KV-cache decoders, the rollout engine (generate, score with the four
models' forward passes) and ``shifu sample``.
"""
