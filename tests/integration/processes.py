"""The integration tests start services with the same process helper the benchmarks use."""
from infra.processes import Service, free_port

__all__ = ["Service", "free_port"]
