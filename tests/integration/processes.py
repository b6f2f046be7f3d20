"""The integration tests start services with the same process helper the benchmarks use."""
from tokenmill.stack.processes import Service, free_port

__all__ = ["Service", "free_port"]
