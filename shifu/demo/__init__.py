"""``shifu demo bandit``: PPO-clip, PPO-penalty and TRPO on a ten-armed bandit, built from the same core losses as
the trainer, to see each formula work on something small enough to print epoch by epoch."""
