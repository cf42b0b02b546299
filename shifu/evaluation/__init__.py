"""Evaluation: how every command that measures a policy measures it — held-out prompts through a rollout source
(single responses, an environment's or an agent's episodes), judges (the source's own return, a gold function,
a reward model), two policies paired on the same prompts and sampling seed with the gain's standard error and
the KL, and one record per prompt. ``shifu ppo``'s held-out and final evaluations, the quickstart's final
evaluation and ``shifu eval`` all measure through this wing, so their figures mean the same thing."""
