"""The policy gateway: an OpenAI-compatible chat completions endpoint on shifu's own sampler, and the sessions
that record every completion it sampled (prompt ids, sampled ids, log-probs, policy version) for training."""
