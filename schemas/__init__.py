"""Event schemas, the Avro codec and topic declarations. Depends on nothing else of ours."""
from schemas.codec import Event, UndecodableEvent, decode, encode, new_event
from schemas import topics

__all__ = ["Event", "UndecodableEvent", "decode", "encode", "new_event", "topics"]
