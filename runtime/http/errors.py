"""The error every handler of the HTTP API raises to answer in the OpenAI error shape."""
from __future__ import annotations


class ApiError(Exception):
    """An error answered in the OpenAI shape with its HTTP status."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
