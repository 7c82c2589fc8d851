"""``GET /openapi.json``: an OpenAPI 3.1 description of every endpoint, built from the pydantic request bodies the
handlers validate with (so it cannot drift from what the server accepts). Fuzzers (schemathesis) and client
generators read it."""
from __future__ import annotations

from typing import Any

#: (path, method, summary, request body model name or None)
ENDPOINTS: tuple[tuple[str, str, str, str | None], ...] = (
    ("/health", "get", "Liveness: 200 once the model is loaded (several models: once the server listens), 503 "
                       "while loading", None),
    ("/v1/models", "get", "The served models and their state (OpenAI, llama-server's status.value)", None),
    ("/v1/completions", "post", "Text completion (OpenAI)", "CompletionRequest"),
    ("/v1/chat/completions", "post", "Chat completion (OpenAI)", "ChatCompletionRequest"),
    ("/v1/embeddings", "post", "Embeddings (OpenAI)", "EmbeddingRequest"),
    ("/v1/messages", "post", "Messages (Anthropic)", "MessagesRequest"),
    ("/v1/messages/count_tokens", "post", "Prompt tokens of a Messages request (Anthropic)", "CountTokensRequest"),
    ("/tokenize", "post", "Tokens of a text (llama-server)", "TokenizeBody"),
    ("/detokenize", "post", "Text of tokens (llama-server)", "DetokenizeBody"),
    ("/metrics", "get", "Prometheus metrics", None),
    ("/openapi.json", "get", "This description", None),
    ("/", "get", "The browser chat page (absent with --no-webui)", None),
)
#: the endpoints that stream with "stream": true
_STREAMING = ("/v1/completions", "/v1/chat/completions", "/v1/messages")
#: what a 200 carries, per path (JSON unless listed)
_MEDIA = {"/metrics": "text/plain", "/": "text/html"}
#: an error in OpenAI's shape (every endpoint but Anthropic's)
OPENAI_ERROR: dict[str, Any] = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}
#: an error in Anthropic's shape (/v1/messages and /v1/messages/count_tokens)
ANTHROPIC_ERROR: dict[str, Any] = {"type": "object", "required": ["type", "error"], "properties": {
    "type": {"const": "error"}, "error": {"type": "object", "required": ["type", "message"], "properties": {
        "type": {"type": "string"}, "message": {"type": "string"}}}}}
#: the error statuses every endpoint may answer, and those of endpoints with a body
_ERROR_STATUSES = ("400", "401", "404", "405", "503")
_BODY_ERROR_STATUSES = ("413",)


def _responses(path: str, has_body: bool) -> dict[str, Any]:
    anthropic = path.startswith("/v1/messages")
    error = {"description": "An error in the endpoint's API shape (" + ("Anthropic" if anthropic else "OpenAI")
             + ")", "content": {"application/json": {"schema": {
                 "$ref": "#/components/schemas/" + ("AnthropicError" if anthropic else "OpenAIError")}}}}
    content: dict[str, Any] = {_MEDIA.get(path, "application/json"): {}}
    if path in _STREAMING:  # server-sent events with "stream": true
        content["text/event-stream"] = {}
    ok = {"description": "OK", "content": content}
    statuses = _ERROR_STATUSES + (_BODY_ERROR_STATUSES if has_body else ())
    responses: dict[str, Any] = {"200": ok, **{status: error for status in statuses}}
    if path == "/health":  # not an error: the state of the model
        responses["503"] = {"description": "The model is loading, or failed to load", "content": {
            "application/json": {"schema": {"type": "object", "required": ["status"], "properties": {
                "status": {"enum": ["loading", "error"]}}}}}}
    return responses


def _models() -> dict[str, Any]:
    from .anthropic import CountTokensRequest, MessagesRequest
    from .protocol import ChatCompletionRequest, CompletionRequest, DetokenizeBody, EmbeddingRequest, TokenizeBody

    return {m.__name__: m for m in (CompletionRequest, ChatCompletionRequest, EmbeddingRequest, MessagesRequest,
                                    CountTokensRequest, TokenizeBody, DetokenizeBody)}


def openapi_spec(version: str = "0") -> dict[str, Any]:
    from pydantic.json_schema import models_json_schema

    models = _models()
    refs, defs = models_json_schema([(m, "validation") for m in models.values()],
                                    ref_template="#/components/schemas/{model}")
    schemas = dict(defs.get("$defs", {}))
    paths: dict[str, Any] = {}
    for path, method, summary, body in ENDPOINTS:
        operation: dict[str, Any] = {"summary": summary, "responses": _responses(path, body is not None)}
        if body is not None:
            schema = refs[(models[body], "validation")]
            operation["requestBody"] = {"required": True, "content": {"application/json": {"schema": schema}}}
        paths.setdefault(path, {})[method] = operation
    schemas.update(OpenAIError=OPENAI_ERROR, AnthropicError=ANTHROPIC_ERROR)
    return {"openapi": "3.1.0", "info": {"title": "llmfw serve", "version": version}, "paths": paths,
            "components": {"schemas": schemas,
                           "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"},
                                               "x-api-key": {"type": "apiKey", "in": "header", "name": "x-api-key"}}}}


async def openapi_endpoint(request: Any) -> Any:
    from starlette.responses import JSONResponse

    try:
        from importlib.metadata import version

        package_version = version("llmfw")
    except Exception:  # noqa: BLE001 - a source checkout without metadata
        package_version = "0"
    return JSONResponse(openapi_spec(package_version))
