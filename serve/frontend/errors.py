"""The OpenAI error envelope, at the HTTP edge only.

`APIError` carries status, message, type, param and code; `error_response` renders it as
`{"error": {"message", "type", "param", "code"}}`. Inside a stream that already started,
`sse_error` renders the same body as one `data:` line (followed by `data: [DONE]`).
"""

from __future__ import annotations

import json

from fastapi.responses import JSONResponse


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def sse_error(err: APIError) -> bytes:
    return b"data: " + json.dumps(err.body()).encode() + b"\n\ndata: [DONE]\n\n"
