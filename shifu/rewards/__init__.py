"""Reward sources for PPO and evaluation: reward functions (``package.module:function``), reward models and
their ensembles, and the client of the reward service (``shifu serve``).
"""
