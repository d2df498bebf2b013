"""Every failure as OpenAI's error body (the `openai` client raises its exception for the status): `APIError` for
the routes to raise, and the app's handlers, which turn a request that fails validation into a 400 whose `param`
names a field the client sent (OpenAI's `messages.[0].content`), or none. (Numbers in answers are kept finite
where they are made: answers.finite.)
"""

from __future__ import annotations

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .protocol import error_body

class APIError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", code: str | None = None,
                 param: str | None = None):
        super().__init__(message)
        self.status, self.body = status, error_body(message, kind, code, param)


def bad(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def field_path(loc, body, missing: bool = False) -> str | None:
    """The field of the client's JSON `body` that a validation error's `loc` points at, as OpenAI writes it
    (`messages.[0].content`): the parts of `loc` found in the body, skipping pydantic's own steps (the members of a
    union, `str` or `list[...]`, which the body does not have); a missing field is named when it is the last part."""
    parts = list(loc[1:] if loc and loc[0] == "body" else loc)
    path, node = [], body
    for i, part in enumerate(parts):
        if isinstance(node, dict) and isinstance(part, str) and part in node:
            path.append(part)
            node = node[part]
        elif isinstance(node, list) and isinstance(part, int) and not isinstance(part, bool) and 0 <= part < len(node):
            path.append(f"[{part}]")
            node = node[part]
        elif missing and i == len(parts) - 1 and isinstance(node, dict) and isinstance(part, str):
            path.append(part)
    return ".".join(path) or None


def _where_in(doc, pos: int) -> str:
    if not isinstance(doc, str) or not isinstance(pos, int):
        return ""
    line = doc.count("\n", 0, pos) + 1
    column = pos - (doc.rfind("\n", 0, pos) + 1) + 1
    return f" at line {line}, column {column} (character {pos})"


def validation_message(e: RequestValidationError) -> tuple[str, str | None]:
    """(message, param) of a request that failed FastAPI's parsing or pydantic's validation."""
    errors = list(e.errors())
    if not errors:
        return "the request is not valid", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        loc = first.get("loc", ())
        reason = (first.get("ctx") or {}).get("error", first.get("msg", "invalid"))
        return f"the body is not valid JSON: {reason}{_where_in(e.body, loc[-1] if loc else None)}", None
    body = e.body
    where = field_path(first.get("loc", ()), body, first.get("type") == "missing")
    if where is None:
        if not isinstance(body, dict):
            return "the body must be a JSON object (with Content-Type: application/json)", None
        return f"the request is not valid: {first.get('msg', 'invalid')}", None
    said = []  # a union's members each fail: their reasons, together
    for error in errors:
        msg = error.get("msg", "invalid")
        if msg not in said and field_path(error.get("loc", ()), body, error.get("type") == "missing") == where:
            said.append(msg)
    return f"{where}: {'; or '.join(said[:3])}", where


def install_error_handlers(app) -> None:
    @app.exception_handler(APIError)
    async def api_error(_, e: APIError):
        return JSONResponse(e.body, status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def invalid(_, e: RequestValidationError):
        message, param = validation_message(e)
        return JSONResponse(error_body(message, "invalid_request_error", param=param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_, e: StarletteHTTPException):
        message, cause = str(e.detail), e.__cause__
        if isinstance(cause, RecursionError):
            message = "the body's JSON is nested too deeply to parse"
        elif isinstance(cause, UnicodeDecodeError):
            message = f"the body is not UTF-8 text (byte {cause.start} cannot be decoded)"
        return JSONResponse(error_body(message, "invalid_request_error"), status_code=e.status_code)

    @app.exception_handler(Exception)
    async def crashed(_, e: Exception):
        return JSONResponse(error_body(f"internal error: {type(e).__name__}: {e}", "server_error"), status_code=500)
