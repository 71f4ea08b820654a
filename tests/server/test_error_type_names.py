"""An HTTP error's type is its status's name plus Error, as vLLM names them; 500's phrase ends in Error already."""

from jaxserve.server.openai.errors import error_body


def test_error_types_are_named_once():
    assert error_body(400, "m")["error"]["type"] == "BadRequestError"
    assert error_body(404, "m")["error"]["type"] == "NotFoundError"
    assert error_body(500, "m")["error"]["type"] == "InternalServerError"
    assert error_body(503, "m")["error"]["type"] == "ServiceUnavailableError"
