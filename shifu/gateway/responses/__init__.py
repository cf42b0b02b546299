"""The OpenAI Responses dialect of the gateway (``POST /v1/responses``): its typed request and answer
(:mod:`~shifu.gateway.responses.protocol`), their translation into the engine's chat request and back
(:mod:`~shifu.gateway.responses.translate`), and its route (:mod:`~shifu.gateway.responses.routes`). Below it,
the engine renders, samples and records as for a chat completion, so calls of either dialect join one session.
"""

from shifu.gateway.responses.routes import openapi, routes

__all__ = ["openapi", "routes"]
