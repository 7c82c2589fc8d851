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
)
_ERROR = {"description": "An error in the endpoint's API shape",
          "content": {"application/json": {"schema": {"type": "object"}}}}


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
        operation: dict[str, Any] = {"summary": summary, "responses": {
            "200": {"description": "OK"}, "400": _ERROR, "401": _ERROR, "503": _ERROR}}
        if body is not None:
            schema = refs[(models[body], "validation")]
            operation["requestBody"] = {"required": True, "content": {"application/json": {"schema": schema}}}
            operation["responses"]["413"] = _ERROR
            operation["responses"]["404"] = _ERROR  # several models: the body's `model` names none of them
        paths.setdefault(path, {})[method] = operation
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
