"""OpenAI's own published API description (openai/openai-openapi, `openapi.yaml`, OpenAPI 3.1) as a validator
of the bodies and stream events tokenmill sends.

The whole document is one `referencing` resource, so every `$ref` resolves inside it exactly as written; the
schema an answer is checked against is the one the spec gives its operation (path, method, status, media type).
OpenAPI 3.1 is JSON Schema 2020-12, except that this document still writes some nullable fields the 3.0 way
(`nullable: true` beside `type`): the validator honours that keyword, and nothing else is changed.

The file lives beside the repository (`../shared/openai-spec/openapi.yaml`; `TOKENMILL_OPENAI_SPEC` names
another copy). Without it the conformance tests fail: they are never skipped.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from jsonschema import Draft202012Validator, validators
from jsonschema.exceptions import best_match
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_SPEC = ROOT.parent / "shared" / "openai-spec" / "openapi.yaml"
BASE_URI = "urn:openai-openapi"
ERROR_SCHEMA = "ErrorResponse"


class SpecMissing(AssertionError):
    """The OpenAI spec file is not where the tests look for it (an assertion: the test fails, not skips)."""


# Where the project's shared folder is when the checkout is not beside it (a clone elsewhere on this
# machine, as CI makes one).
WORKPLACE_SPEC = Path("/work/shared/openai-spec/openapi.yaml")


def spec_path() -> Path:
    """TOKENMILL_OPENAI_SPEC, else the shared folder beside the checkout (or above it), else the
    workplace's; the first of those when none exists, so the error names where it was looked for."""
    if os.environ.get("TOKENMILL_OPENAI_SPEC"):
        return Path(os.environ["TOKENMILL_OPENAI_SPEC"])
    beside = [parent / "shared" / "openai-spec" / "openapi.yaml" for parent in ROOT.parents]
    return next((path for path in [*beside, WORKPLACE_SPEC] if path.is_file()), DEFAULT_SPEC)


def _nullable(keyword):
    """OpenAPI 3.0's `nullable: true`: null is allowed whatever `type` (or `enum`) says."""
    def check(validator, value, instance, schema):
        if instance is None and schema.get("nullable") is True:
            return
        yield from keyword(validator, value, instance, schema)
    return check


OpenAPIValidator = validators.extend(Draft202012Validator, {
    keyword: _nullable(Draft202012Validator.VALIDATORS[keyword]) for keyword in ("type", "enum")})


def _pointer_escape(part: str) -> str:
    return part.replace("~", "~0").replace("/", "~1")


@dataclass(frozen=True)
class Violation:
    path: str  # where in the instance, as a JSON path
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}"


class OpenAISpec:
    def __init__(self, document: dict[str, Any], source: Path):
        self.document = document
        self.source = source
        resource = Resource.from_contents(document, default_specification=DRAFT202012)
        self.registry = Registry().with_resource(BASE_URI, resource)
        self.schemas = document["components"]["schemas"]
        self._validators: dict[str, Any] = {}

    @classmethod
    def load(cls, path: Path | None = None) -> "OpenAISpec":
        path = path or spec_path()
        if not path.is_file():
            raise SpecMissing(f"OpenAI's API description is missing: {path} (openai/openai-openapi openapi.yaml; "
                              "TOKENMILL_OPENAI_SPEC may name another copy)")
        with path.open("rb") as f:
            document = yaml.load(f, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
        if not str(document.get("openapi", "")).startswith("3.1"):
            raise SpecMissing(f"{path} is not an OpenAPI 3.1 document (openapi: {document.get('openapi')!r})")
        return cls(document, path)

    # --- which schema ---
    def operation_schema(self, method: str, path: str, status: int,
                         media_type: str = "application/json") -> str | None:
        """The JSON pointer (in this document) of the schema the spec gives an answer of the operation, or None
        when the operation declares no body for it. An error status the operation does not list has the
        spec's general `ErrorResponse`; a stream an operation describes only as JSON (completions: "both the
        streamed and non-streamed response objects share the same shape") has its JSON schema."""
        operation = self.document["paths"][path][method.lower()]
        answer = operation["responses"].get(str(status))
        if answer is None:
            if status >= 400:
                return self.component(ERROR_SCHEMA)
            raise KeyError(f"{method} {path} declares no {status} answer")
        if "$ref" in answer:
            return None if status < 400 else self.component(ERROR_SCHEMA)
        content = answer.get("content") or {}
        if media_type not in content and media_type == "text/event-stream":
            media_type = "application/json"
        if media_type not in content:
            return None if status < 400 else self.component(ERROR_SCHEMA)
        return "#/" + "/".join(_pointer_escape(p) for p in
                               ("paths", path, method.lower(), "responses", str(status), "content", media_type,
                                "schema"))

    def component(self, name: str) -> str:
        if name not in self.schemas:
            raise KeyError(f"the spec has no component schema {name!r}")
        return f"#/components/schemas/{_pointer_escape(name)}"

    def stream_event_component(self, event_type: str) -> str | None:
        """The branch of `ResponseStreamEvent` whose `type` is `event_type` (None: the spec has no such event)."""
        for branch in self.schemas["ResponseStreamEvent"]["anyOf"]:
            name = branch["$ref"].rsplit("/", 1)[-1]
            kind = self.schemas[name].get("properties", {}).get("type", {})
            if event_type in (kind.get("enum") or []) or kind.get("const") == event_type:
                return self.component(name)
        return None

    # --- validating ---
    def _validator(self, pointer: str):
        validator = self._validators.get(pointer)
        if validator is None:
            validator = OpenAPIValidator({"$ref": BASE_URI + pointer}, registry=self.registry)
            self._validators[pointer] = validator
        return validator

    def violations(self, instance: Any, pointer: str) -> list[Violation]:
        """Every way `instance` breaks the schema at `pointer`; for a union (`anyOf`/`oneOf`) that nothing
        matched, the reasons of the branch it came closest to."""
        found = []
        for error in self._validator(pointer).iter_errors(instance):
            best = best_match([error])
            found.append(Violation(best.json_path, best.message[:300]))
        return found


@functools.lru_cache(maxsize=1)
def openai_spec() -> OpenAISpec:
    return OpenAISpec.load()
