"""schemas/records.py: the event record types the type checker holds event-reading code to."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from schemas import codec, records
from schemas.record_types import RECORDS_PY, generate


def test_records_py_is_generated_from_the_current_schemas():
    assert RECORDS_PY.read_text() == generate(), "run `python -m schemas.record_types` after changing a schema"


def test_every_event_has_its_type_with_the_newest_schemas_fields():
    for name in codec.EVENT_NAMES:
        kind = getattr(records, name)
        fields = [f["name"] for f in codec.parsed_schema(name)["fields"]]
        assert list(kind.__annotations__) == fields, name


def test_a_decoded_event_is_typed_as_its_own_kind_and_refused_as_another():
    record = codec.new_event("RequestCancelled", request_id="r-1", tenant_id="acme", reason="client")
    event = codec.decode(*codec.encode("RequestCancelled", record))
    assert codec.record_of(event, records.RequestCancelled)["tenant_id"] == "acme"
    with pytest.raises(codec.UndecodableEvent):
        codec.record_of(event, records.RequestCompleted)


def test_the_type_checker_refuses_a_misspelt_field(tmp_path):
    reader = tmp_path / "reader.py"
    reader.write_text(textwrap.dedent("""
        from schemas import codec
        from schemas.records import RequestCompleted

        def billed(event: codec.Event) -> int:
            usage = codec.record_of(event, RequestCompleted)
            return usage["completion_tokens"] + usage["complition_tokens"]
    """))
    checked = subprocess.run([sys.executable, "-m", "mypy", "--no-incremental", str(reader)],
                             capture_output=True, text=True)
    assert checked.returncode == 1 and '"complition_tokens"' in checked.stdout, checked.stdout
    assert checked.stdout.count("error:") == 1, checked.stdout
