"""``shifu serve``: a reward model or reward function behind an HTTP API, with request validation and dynamic
batching.
"""
