"""`python -m infra.fetch_jars`: make sure Kafka's broker jars are in the local cache, and the class
archive every broker start maps (infra/kafka_class_archive.py) is made for them."""
from infra.kafka_broker import ensure_jars
from infra.kafka_class_archive import ensure_class_archive

if __name__ == "__main__":
    print(f"Kafka jars in {ensure_jars()}, class archive {ensure_class_archive().name}")
