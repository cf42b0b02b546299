"""``shifu bench``: timed PPO iterations of shifu on a fixed offline workload (random models and prompts from seeds,
analytic FLOPs), one JSON line; it runs from an installed wheel (``benchmarks/`` adds the comparisons that need a
checkout)."""
