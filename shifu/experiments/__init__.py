"""Whole pipelines on built-in tasks: the shared stages (prepare, SFT, pairs, reward model), ``shifu
quickstart``, ``shifu study`` (method comparisons at matched KL), ``shifu demo`` and ``shifu bench``.
"""
