"""The one error type every route answers with, in the OpenAI shape."""

from __future__ import annotations

from verispec.entrypoints.openai.protocol import ErrorInfo, ErrorResponse

# Status -> OpenAI error type; any other 4xx is the client's (BadRequestError), 5xx the server's.
_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 405: "MethodNotAllowedError",
          413: "RequestTooLargeError", 499: "ClientDisconnectedError", 503: "ServiceUnavailableError"}


class RequestError(Exception):
    """An error answered in the OpenAI shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, type_: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.headers = headers
        self.type = type_ or _TYPES.get(status, "BadRequestError" if status < 500 else "InternalServerError")

    def response_body(self) -> ErrorResponse:
        return ErrorResponse(error=ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.status))
