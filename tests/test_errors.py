"""The one error type of the HTTP API (verispec/entrypoints/openai/errors.py): its status picks the
OpenAI error type (client errors vs server errors), and its body has OpenAI's shape."""

from __future__ import annotations

import pytest

from verispec.entrypoints.openai.errors import RequestError


@pytest.mark.parametrize("status, type_", [
    (400, "BadRequestError"), (401, "AuthenticationError"), (404, "NotFoundError"),
    (413, "RequestTooLargeError"), (503, "ServiceUnavailableError"),
    (422, "BadRequestError"),  # any other 4xx is the client's
    (500, "InternalServerError"), (502, "InternalServerError"),  # any other 5xx the server's
])
def test_the_status_picks_the_openai_type(status, type_):
    assert RequestError("m", status=status).type == type_


def test_an_explicit_type_wins_over_the_status():
    assert RequestError("m", status=401, type_="PermissionDeniedError").type == "PermissionDeniedError"


def test_the_body_is_openais_shape_with_the_field_and_the_code():
    body = RequestError("n must be at most 16; got 20", "n").response_body().model_dump()
    assert body == {"error": {"message": "n must be at most 16; got 20", "type": "BadRequestError", "param": "n",
                              "code": 400}}
    assert str(RequestError("why")) == "why"  # an exception whose text is the message
