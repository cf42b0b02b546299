"""The policy gateway: OpenAI chat completions, OpenAI Responses (:mod:`shifu.gateway.responses`) and Anthropic
Messages (:mod:`shifu.gateway.messages`) on shifu's own sampler, and the sessions that record every completion
it sampled (prompt ids, sampled ids, log-probs, policy version) for training, whichever dialect asked.

The Python API of a trainer: :class:`Gateway` (``start``, ``base_url``, ``start_session``, ``set_reward``,
``end_session``, ``set_policy``, ``set_sampling``, ``close``) and what a session records,
:class:`RecordedSession` / :class:`Trajectory` / :class:`Segment` (:mod:`shifu.gateway.sessions`).
"""

from shifu.gateway.completions import Sampling
from shifu.gateway.gateway import Gateway
from shifu.gateway.sessions import RecordedSession, Segment, Trajectory

__all__ = ["Gateway", "RecordedSession", "Sampling", "Segment", "Trajectory"]
