"""Who is calling: the tenant and key of a request's API key, or a 401 in the OpenAI format."""
from __future__ import annotations

from starlette.datastructures import Headers

from http_api.bearer import bearer_token
from http_api.openai_errors import APIError
from ingress.tenancy.directory import Caller, TenantDirectory


class Authenticator:
    def __init__(self, directory: TenantDirectory, secret: bytes):
        self.directory, self.secret = directory, secret

    def caller(self, headers: Headers) -> Caller:
        header = headers.get("authorization", "")
        if not header:
            raise APIError(401, "You didn't provide an API key. Send it as 'Authorization: Bearer <key>'.",
                           code="missing_api_key")
        caller = self.directory.authenticate(bearer_token(header), self.secret)
        if caller is None:
            raise APIError(401, "Incorrect, revoked or unknown API key.", code="invalid_api_key")
        return caller
