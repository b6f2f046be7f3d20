"""`python -m infra.fetch_jars`: make sure Kafka's broker jars are in the local cache."""
from infra.kafka_broker import ensure_jars

if __name__ == "__main__":
    print(f"Kafka jars in {ensure_jars()}")
