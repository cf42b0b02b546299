"""The OpenAI chat completions dialect of the gateway (``POST /v1/chat/completions``): its typed request, answer
and stream chunks (:mod:`~shifu.gateway.chat.protocol`), the request's translation into the engine's
(:mod:`~shifu.gateway.chat.translate`), its chunks (:mod:`~shifu.gateway.chat.stream`) and its route
(:mod:`~shifu.gateway.chat.routes`). The engine's answer is a chat completion, so calls of this dialect and the
others join one session.
"""

from shifu.gateway.chat.routes import openapi, routes

__all__ = ["openapi", "routes"]
