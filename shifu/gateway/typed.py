"""Dialects declared as typed models (pydantic): each dialect's requests, answers and stream events are
:class:`Strict` models, from which its validation (:func:`validated`) and its part of the OpenAPI document
(:func:`components`, :func:`event_stream`) both come. A body reaches them already read by the strict JSON layer (:func:`shifu.http.requests.decode_body`:
duplicate keys, NaN, depth, size); a model then refuses any field it does not declare and any value of the
wrong JSON type (strict mode: no string for a number, no number for a boolean), and the 400 names the field's
path in the body (``messages[1].content[0].input``), as the chat dialect's hand-written checks do.

A union of object shapes is tagged by their ``type`` (:func:`by_type`), so that a refusal speaks of the shape
the client meant (the ``tool_use`` block it sent), not of every shape it might have meant.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, Tag, ValidationError
from pydantic.json_schema import models_json_schema

from shifu.http.requests import RequestError, field_path, json_type

REF = "#/components/schemas/{model}"


class Strict(BaseModel):
    """A dialect's object: unknown fields refused, JSON types exact."""

    model_config = ConfigDict(extra="forbid", strict=True)


def _integral(value):
    """A number with no fraction (``3.0``) is an integer, as in JSON Schema."""
    return int(value) if type(value) is float and value.is_integer() else value


Integral = BeforeValidator(_integral)
Count = Annotated[int, Field(ge=1), Integral]  # a token budget
TAGS = ("type", "role")  # the fields a union of object shapes is told apart by


def by_type(
    *members: type[Strict], default: str | None = None, key: str = "type", aliases: dict | None = None
) -> Any:
    """A union of ``members`` chosen by the object's ``key`` (``type``, or ``role`` for chat messages: each
    member's first literal of it); ``default``: the member of an object without it (a Responses message item);
    ``aliases``: other values that choose a member (``{"developer": "system"}``)."""

    def tag(value):
        if isinstance(value, dict):
            found = value.get(key, default)
            return (aliases or {}).get(found, found) if isinstance(found, str) else found
        return None

    tag.__name__ = key  # pydantic names the discriminator after the function: ``role()`` (see validated)
    if len(members) == 1:
        return members[0]
    tagged = [Annotated[m, Tag(_tag(m))] for m in members]
    return Annotated[_union(tagged), Discriminator(tag)]


def _union(types: list) -> Any:
    from typing import Union

    return Union[tuple(types)]  # noqa: UP007 (a runtime union of Annotated members)


def _walk(body, loc: tuple, missing: bool) -> tuple[str, int]:
    """The path in ``body`` of a pydantic error location, and how many of its steps are the body's: the
    location's other steps (union members, tags) are not; with ``missing``, the last step names a field the
    body lacks."""
    node, path, depth = body, "", 0
    for i, step in enumerate(loc):
        if isinstance(node, list) and isinstance(step, int) and 0 <= step < len(node):
            node, path, depth = node[step], field_path(path, step), depth + 1
        elif isinstance(node, dict) and isinstance(step, str):
            if step in node:
                node, path, depth = node[step], field_path(path, step), depth + 1
            elif missing and i == len(loc) - 1:
                path, depth = field_path(path, step), depth + 1
    return path or "body", depth


def _message(error: dict, hint: str) -> tuple[str, str]:
    """``(message, code)`` of one pydantic error, in the gateway's words; ``hint``: what an unknown field's
    object takes."""
    kind, ctx = error["type"], error.get("ctx") or {}
    if kind == "extra_forbidden":
        return f"unknown or unsupported field; {hint}", "unknown_field"
    if kind == "missing":
        return "missing: this field is required", "invalid_value"
    if kind == "union_tag_invalid":
        return (
            f"{_key(error)} {ctx.get('tag')!r} is not supported here; expected one of {ctx.get('expected_tags')}",
            "unsupported_value",
        )
    if kind == "union_tag_not_found":
        return "expected an object with a type", "invalid_value"
    if kind == "literal_error":
        return f"expected {ctx.get('expected')}, got {error['input']!r}"[:300], "unsupported_value"
    if kind == "value_error":
        return str(ctx.get("error", error["msg"])), "unsupported_value"
    msg = error["msg"][0].lower() + error["msg"][1:]
    if kind.endswith("_type"):
        msg += f", got {json_type(error['input'])}"
    return msg, "invalid_value"


def _key(error: dict) -> str:
    """The field a tagged union's error chose by (``type`` or ``role``: :func:`by_type` names its function)."""
    return str((error.get("ctx") or {}).get("discriminator", "type()")).removesuffix("()")


def _hint(model: type[BaseModel], loc: tuple) -> str:
    """What the object of an ``extra_forbidden`` error at ``loc`` takes: its model's ``unknown_hint`` where it
    has one, else its fields."""
    target = _model_at(model, loc)
    if hasattr(target, "unknown_hint"):
        return target.unknown_hint()
    names = [f.alias or name for name, f in target.model_fields.items()]
    return f"this gateway takes {', '.join(names)} here"


def _model_at(model: type[BaseModel], loc: tuple) -> type[BaseModel]:
    """The model of the object at an error's ``loc``: found by following the location's field names, and among
    a union's members the one its tag step names."""
    target, members = model, []
    for step in loc[:-1]:
        if not isinstance(step, str):
            continue
        tagged = [m for m in members if _tag(m) == step]
        if tagged:  # a union's member, chosen by its tag
            target, members = tagged[0], []
        elif step in target.model_fields:
            members = _models_in(target.model_fields[step].annotation)
            target = members[0] if len(members) == 1 else target
    return target


def _tag(member: type[BaseModel]) -> str | None:
    """The ``type`` (or ``role``) a member of a tagged union declares (its first literal), if any."""
    for key in TAGS:
        field = member.model_fields.get(key)
        args = getattr(field.annotation, "__args__", ()) if field is not None else ()
        if args and isinstance(args[0], str):
            return args[0]
    return None


def _models_in(annotation) -> list[type[BaseModel]]:
    found, stack = [], [annotation]
    while stack:
        a = stack.pop()
        if isinstance(a, type) and issubclass(a, BaseModel):
            found.append(a)
        stack += list(getattr(a, "__args__", ()) or ())
    return found


def validated(model: type[Strict], body):
    """``body`` (a decoded JSON value) as ``model``; a 400 naming the deepest field at fault."""
    if not isinstance(body, dict):
        raise RequestError(
            400, "body", f"body: the body must be a JSON object, got {json_type(body)}", code="invalid_value"
        )
    try:
        return model.model_validate(body)
    except ValidationError as e:
        errors = e.errors(include_url=False)
    walked = [(*_walk(body, err["loc"], err["type"] == "missing"), err) for err in errors]
    deepest = max(d for _, d, _ in walked)
    # at the deepest place, an error of a union member whose JSON type fits says more than a type mismatch
    candidates = [(p, err) for p, d, err in walked if d == deepest]
    fitting = [c for c in candidates if not c[1]["type"].endswith("_type")]
    path, error = (fitting or candidates)[0]
    hint = _hint(model, error["loc"]) if error["type"] == "extra_forbidden" else ""
    message, code = _message(error, hint)
    if error["type"] == "union_tag_invalid" and _key(error) != "type":  # a chat message's role: name it
        path = field_path(path, _key(error))
    if not fitting:  # the value's JSON type fits none of the members: name them all
        others = sorted({_message(err, "")[0] for p, err in candidates if p == path and err is not error})
        message += "".join(f" (or: {o})" for o in others)
    raise RequestError(400, path, f"{path}: {message}", code=code)


def components(*models: type[BaseModel]) -> dict:
    """The OpenAPI ``components.schemas`` of ``models`` and every model they hold, named by class."""
    _, defs = models_json_schema([(m, "validation") for m in models], ref_template=REF)
    return _no_null_defaults(defs.get("$defs", {}))


def _no_null_defaults(schema):
    """``schema`` without ``"default": null``: a field left out means its absence (a default the field's own
    type may not allow, which OpenAPI's validators refuse)."""
    if isinstance(schema, dict):
        return {k: _no_null_defaults(v) for k, v in schema.items() if not (k == "default" and v is None)}
    if isinstance(schema, list):
        return [_no_null_defaults(v) for v in schema]
    return schema


def event_stream(name: str, *events: type[Strict]) -> tuple[dict, dict]:
    """``(media type object, schemas)`` of a Server-Sent Events answer whose events are ``events`` (each
    ``event: <its type>``, ``data: <it as JSON>``): each event described by ``schema`` (as OpenAPI 3.1 reads
    an event stream), its data by the union ``name`` of the event models, added to the schemas."""
    from pydantic import TypeAdapter

    union = TypeAdapter(by_type(*events)).json_schema(ref_template=REF)
    schemas = union.pop("$defs", {}) | {name: union | {"title": name}}
    kinds = [_tag(e) for e in events]
    data = {
        "type": "string",
        "contentMediaType": "application/json",
        "contentSchema": {"$ref": REF.format(model=name)},
    }
    event = {
        "type": "object",
        "required": ["event", "data"],
        "properties": {"event": {"enum": kinds}, "data": data},
    }
    return {"schema": event}, schemas


def post_operation(
    operation_id: str,
    summary: str,
    security: list[dict],
    models: tuple[str, str],
    answered: str,
    stream: dict,
    refusals: dict,
    failed: dict,
    description: str | None = None,
) -> dict:
    """A dialect's OpenAPI POST operation: a JSON body of the schema ``models[0]``, answered (``answered``
    describes it) by ``models[1]``, or with stream true by ``stream`` (an event-stream media type object); its
    ``refusals`` by status, and ``failed`` (500) when the sampler fails."""
    request, answer = (REF.format(model=m) for m in models)
    operation = {"operationId": operation_id, "summary": summary}
    if description is not None:
        operation["description"] = description
    content = {"application/json": {"schema": {"$ref": answer}}, "text/event-stream": stream}
    return operation | {
        "security": security,
        "requestBody": {"required": True, "content": {"application/json": {"schema": {"$ref": request}}}},
        "responses": {"200": {"description": answered, "content": content}, **refusals, "500": failed},
    }


def renamed(e: RequestError, field: str) -> RequestError:
    """A refusal of the engine's ``response_format`` (:func:`shifu.gateway.completions.json_grammar`) as one
    of the dialect's own ``field`` (``text.format``), its schema at ``<field>.schema``; other refusals as
    they are."""
    if e.field is None or not e.field.startswith("response_format"):
        return e
    path = field + e.field.removeprefix("response_format").replace(".json_schema.schema", ".schema")
    message = (path + e.message.removeprefix(e.field)).replace("response_format", field)
    return RequestError(e.status, path, message, e.headers, e.code)
