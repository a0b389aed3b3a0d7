"""The api's request errors: an ApiError raised by a route becomes OpenAI's error body with its status."""

from __future__ import annotations

from fastapi.responses import JSONResponse

from server.protocol import error_body


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers


def error_response(e: ApiError) -> JSONResponse:
    return JSONResponse(error_body(e.message, e.status, e.param, e.code), status_code=e.status, headers=e.headers)
