"""The front door: ``shifu quickstart``, a built-in task end to end (prepare, SFT, preference pairs, reward model,
PPO, the paired before/after evaluation, the report), and the stages and run-directory rules every pipeline of
trainer runs shares (the study runs on them too)."""
