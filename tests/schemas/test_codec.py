import json

import fastavro
import pytest

from schemas import codec
from schemas.codec import UndecodableEvent, decode, encode, new_event


def _sample(schema):
    """Build a value for any Avro schema, exercising every field."""
    if isinstance(schema, list):
        non_null = [s for s in schema if s != "null"]
        return _sample(non_null[0]) if non_null else None
    if isinstance(schema, dict):
        t = schema["type"]
        if t == "record":
            return {f["name"]: _sample(f["type"]) for f in schema["fields"]}
        if t == "array":
            return [_sample(schema["items"])]
        if t == "map":
            return {"k": _sample(schema["values"])}
        return _sample(t)
    return {"string": "s", "int": 7, "long": 7, "double": 0.5, "float": 0.5,
            "boolean": True, "bytes": b"\x00\xff", "null": None}[schema]


@pytest.mark.parametrize("name", codec.EVENT_NAMES)
def test_every_event_round_trips(name):
    raw = json.loads(codec.VERSIONS[name][codec.latest_version(name)].read_text())
    record = _sample(raw)
    value, headers = encode(name, record)
    event = decode(value, headers)
    assert event.name == name
    assert event.record == record


@pytest.mark.parametrize("name", codec.EVENT_NAMES)
def test_each_schema_reads_every_older_version(name):
    """Backward compatibility: data written with any earlier version decodes with the newest."""
    reader = codec.parsed_schema(name)
    reader_raw = json.loads(codec.VERSIONS[name][codec.latest_version(name)].read_text())
    for version, path in sorted(codec.VERSIONS[name].items()):
        writer_raw = json.loads(path.read_text())
        writer_fields = {f["name"] for f in writer_raw["fields"]}
        for field in reader_raw["fields"]:
            if field["name"] not in writer_fields:
                assert "default" in field, f"{name} v{version}: new field {field['name']} needs a default"
        record = _sample(writer_raw)
        import io
        buf = io.BytesIO()
        fastavro.schemaless_writer(buf, fastavro.parse_schema(writer_raw), record)
        buf.seek(0)
        decoded = fastavro.schemaless_reader(buf, fastavro.parse_schema(writer_raw), reader)
        for key in writer_fields & {f["name"] for f in reader_raw["fields"]}:
            assert decoded[key] == record[key]


def test_new_event_fills_envelope():
    rec = new_event("RequestCancelled", request_id="r1", tenant_id="t", reason="x")
    assert len(rec["event_id"]) == 32 and rec["timestamp_ms"] > 1_600_000_000_000
    assert decode(*encode("RequestCancelled", rec)).record["request_id"] == "r1"


@pytest.mark.parametrize(
    "value,headers,reason",
    [
        (b"\x01\x02", [], "missing"),
        (b"\x01", [("tm-event", b"Nope"), ("tm-schema-version", b"1")], "unknown event"),
        (b"\x01", [("tm-event", b"RequestCancelled"), ("tm-schema-version", b"99")], "unknown schema version"),
        (b"\xff\xff\xff", [("tm-event", b"RequestCancelled"), ("tm-schema-version", b"1")], "corrupt"),
        (None, [("tm-event", b"RequestCancelled"), ("tm-schema-version", b"1")], "empty"),
    ],
)
def test_garbage_is_reported_not_raised_raw(value, headers, reason):
    with pytest.raises(UndecodableEvent, match=reason):
        decode(value, headers)


def test_trailing_bytes_and_wrong_topic_rejected():
    value, headers = encode("RequestCancelled", new_event("RequestCancelled", request_id="r", tenant_id="t"))
    with pytest.raises(UndecodableEvent, match="trailing"):
        decode(value + b"junk", headers)
    with pytest.raises(UndecodableEvent, match="does not belong"):
        decode(value, headers, expect=("ReplyBatch",))
