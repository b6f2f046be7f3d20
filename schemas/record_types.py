"""Writes schemas/records.py: a TypedDict for every event, from the newest version of its `.avsc`.

A decoded record is a dict with every field of the reader's schema present (Avro fills the defaults),
so each TypedDict is total. Code that reads an event names its type (`codec.record_of(event,
RequestCompleted)`), and the type checker (mypy, run by `make test`) then refuses a misspelt or
missing field where a plain dict would have raised KeyError inside a worker.

Run `python -m schemas.record_types` after changing a schema; tests/schemas/test_record_types.py
fails while records.py is out of date.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from schemas import codec

RECORDS_PY = Path(__file__).with_name("records.py")
PRIMITIVES = {"string": "str", "int": "int", "long": "int", "double": "float", "float": "float",
              "boolean": "bool", "bytes": "bytes", "null": "None"}
HEADER = '''"""Event record types, generated from schemas/avro/*.avsc by `python -m schemas.record_types`:
do not edit by hand (tests/schemas/test_record_types.py checks it is current)."""
from __future__ import annotations

from typing import TypedDict
'''


class _Writer:
    def __init__(self) -> None:
        self.classes: dict[str, str] = {}  # record name -> class source, nested records first

    def type_of(self, avro: Any) -> str:
        if isinstance(avro, str):
            if avro in PRIMITIVES:
                return PRIMITIVES[avro]
            return avro.rsplit(".", 1)[-1]  # a named record defined earlier
        if isinstance(avro, list):
            return " | ".join(self.type_of(branch) for branch in avro)
        kind = avro["type"]
        if kind == "record":
            return self.record(avro)
        if kind == "array":
            return f"list[{self.type_of(avro['items'])}]"
        if kind == "map":
            return f"dict[str, {self.type_of(avro['values'])}]"
        if kind == "enum":
            return "str"
        return self.type_of(kind)

    def record(self, schema: dict[str, Any]) -> str:
        name = schema["name"]
        if name in self.classes:
            return name
        self.classes[name] = ""  # reserved: a field of this record may name it
        lines = [f"class {name}(TypedDict):"]
        if schema.get("doc"):
            lines.append(f'    """{schema["doc"]}"""')
        for field in schema["fields"]:
            lines.append(f"    {field['name']}: {self.type_of(field['type'])}")
        del self.classes[name]
        self.classes[name] = "\n".join(lines)
        return name


def generate() -> str:
    writer = _Writer()
    for event in codec.EVENT_NAMES:
        version = codec.latest_version(event)
        writer.record(json.loads(codec.VERSIONS[event][version].read_text()))
    return HEADER + "".join(f"\n\n{source}\n" for source in writer.classes.values())


if __name__ == "__main__":
    RECORDS_PY.write_text(generate())
    print(f"wrote {RECORDS_PY}", file=sys.stderr)
