"""The OpenAPI 3.1 document of the gateway, derived from the field tables in protocol.py."""

from __future__ import annotations

from moemesh.services.router.protocol import CHAT_FIELDS, COMPLETION_FIELDS, FieldSpec

_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}

_USAGE = {
    "type": "object",
    "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
    "properties": {
        "prompt_tokens": {"type": "integer"},
        "completion_tokens": {"type": "integer"},
        "total_tokens": {"type": "integer"},
        "prompt_tokens_details": {"type": "object", "properties": {"cached_tokens": {"type": "integer"}}},
        "speculative": {
            "type": "object",
            "properties": {
                "ran": {"type": "boolean"},
                "draft_tokens": {"type": "integer"},
                "accepted_tokens": {"type": "integer"},
                "mean_accepted_length": {"type": "number"},
            },
        },
    },
}

_MESSAGE = {
    "type": "object",
    "required": ["role"],
    "properties": {
        "role": {"type": "string", "enum": ["system", "developer", "user", "assistant", "tool"]},
        "content": {"type": ["string", "array", "null"], "items": {"type": "object"}},
        "reasoning_content": {"type": ["string", "null"]},
        "tool_calls": {"type": "array", "items": {"type": "object"}},
        "tool_call_id": {"type": "string"},
        "name": {"type": "string"},
    },
}


def _field_schema(spec: FieldSpec) -> dict:
    schema: dict = {"type": list(spec.json_types) if len(spec.json_types) > 1 else spec.json_types[0],
                    "description": spec.description}
    if spec.minimum is not None:
        schema["minimum"] = spec.minimum
    if spec.maximum is not None:
        schema["maximum"] = spec.maximum
    if spec.name == "messages":
        schema["items"] = _MESSAGE
        schema["minItems"] = 1
    elif spec.items:
        schema["items"] = {"type": list(spec.items) if len(spec.items) > 1 else spec.items[0]}
    elif "array" in spec.json_types:
        schema["items"] = {}
    return schema


def _body_schema(specs: tuple[FieldSpec, ...], required: str) -> dict:
    return {"type": "object", "required": [required], "properties": {s.name: _field_schema(s) for s in specs}}


def _json(schema: dict) -> dict:
    return {"application/json": {"schema": schema}}


def _generation_operation(summary: str, body_ref: str, response_ref: str) -> dict:
    return {
        "summary": summary,
        "requestBody": {"required": True, "content": _json({"$ref": body_ref})},
        "responses": {
            "200": {
                "description": "The completion, or server-sent events when stream is true.",
                "content": {**_json({"$ref": response_ref}), "text/event-stream": {"schema": {"type": "string"}}},
            },
            "400": {"description": "Invalid request.", "content": _json({"$ref": "#/components/schemas/Error"})},
            "404": {"description": "Unknown model.", "content": _json({"$ref": "#/components/schemas/Error"})},
            "413": {"description": "Body too large.", "content": _json({"$ref": "#/components/schemas/Error"})},
            "429": {"description": "Overloaded; see Retry-After.",
                    "headers": {"Retry-After": {"schema": {"type": "integer"}}},
                    "content": _json({"$ref": "#/components/schemas/Error"})},
            "503": {"description": "Engine unavailable.", "content": _json({"$ref": "#/components/schemas/Error"})},
            "504": {"description": "Deadline exceeded.", "content": _json({"$ref": "#/components/schemas/Error"})},
        },
    }


def openapi_document(model_name: str) -> dict:
    choice_common = {"index": {"type": "integer"}, "finish_reason": {"type": ["string", "null"]},
                     "logprobs": {"type": ["object", "null"]}}
    return {
        "openapi": "3.1.0",
        "info": {"title": "moemesh gateway", "version": "0.1.0",
                 "description": f"OpenAI-compatible API serving {model_name}."},
        "paths": {
            "/v1/chat/completions": {"post": _generation_operation(
                "Chat completion", "#/components/schemas/ChatCompletionRequest", "#/components/schemas/ChatCompletion")},
            "/v1/completions": {"post": _generation_operation(
                "Text completion", "#/components/schemas/CompletionRequest", "#/components/schemas/Completion")},
            "/v1/models": {"get": {"summary": "Served models", "responses": {"200": {
                "description": "Model list", "content": _json({"$ref": "#/components/schemas/ModelList"})}}}},
            "/health": {"get": {"summary": "Health of the gateway and its workers", "responses": {
                "200": {"description": "Healthy", "content": _json({"$ref": "#/components/schemas/Health"})},
                "503": {"description": "A needed worker is down", "content": _json({"$ref": "#/components/schemas/Health"})},
            }}},
            "/metrics": {"get": {"summary": "Prometheus metrics", "responses": {"200": {
                "description": "Text exposition format", "content": {"text/plain": {"schema": {"type": "string"}}}}}}},
        },
        "components": {"schemas": {
            "Error": _ERROR,
            "Usage": _USAGE,
            "ChatCompletionRequest": _body_schema(CHAT_FIELDS, "messages"),
            "CompletionRequest": _body_schema(COMPLETION_FIELDS, "prompt"),
            "ChatCompletion": {"type": "object", "required": ["id", "object", "choices"], "properties": {
                "id": {"type": "string"}, "object": {"type": "string"}, "created": {"type": "integer"},
                "model": {"type": "string"}, "usage": {"$ref": "#/components/schemas/Usage"},
                "choices": {"type": "array", "items": {"type": "object", "properties": {
                    **choice_common, "message": _MESSAGE}}}}},
            "Completion": {"type": "object", "required": ["id", "object", "choices"], "properties": {
                "id": {"type": "string"}, "object": {"type": "string"}, "created": {"type": "integer"},
                "model": {"type": "string"}, "usage": {"$ref": "#/components/schemas/Usage"},
                "choices": {"type": "array", "items": {"type": "object", "properties": {
                    **choice_common, "text": {"type": "string"}}}}}},
            "ModelList": {"type": "object", "properties": {"object": {"type": "string"}, "data": {
                "type": "array", "items": {"type": "object", "properties": {
                    "id": {"type": "string"}, "object": {"type": "string"}, "created": {"type": "integer"},
                    "owned_by": {"type": "string"}, "max_model_len": {"type": "integer"}}}}}},
            "Health": {"type": "object", "properties": {"status": {"type": "string"},
                                                        "services": {"type": "object"}}},
        }},
    }
