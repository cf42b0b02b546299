"""The Anthropic Messages dialect of the gateway (``POST /v1/messages``): its typed request and answer
(:mod:`~shifu.gateway.messages.protocol`), their translation into the engine's chat request and back
(:mod:`~shifu.gateway.messages.translate`), and its route (:mod:`~shifu.gateway.messages.routes`), which
answers refusals in Anthropic's error shape. Below it, the engine renders, samples and records as for a chat
completion, so calls of any dialect join one session.
"""

from shifu.gateway.messages.routes import openapi, routes

__all__ = ["openapi", "routes"]
