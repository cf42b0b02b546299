"""Rollout sources: every way shifu makes trajectories for training and evaluation — single-turn sampling scored
by a reward source, multi-turn episodes with an environment, outside agents over the policy gateway — returns the
same :class:`~shifu.rollout.batch.Trajectories` batch, and the trainers and evaluations read only that batch."""
