"""shifu: PPO-RLHF."""

__version__ = "0.1.0"
