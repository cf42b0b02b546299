"""The trainers: ``sft`` (supervised fine-tuning), ``reward`` (the Bradley-Terry reward model), ``dpo`` and ``ppo``
(with the critic-free estimators), each a short loop of ``shifu.core`` calls that reads top to bottom; ``loop``
is the one training loop of sft, rm and dpo, and the ``ppo_*`` modules are PPO's phases in order.
"""
