"""The hooks the gate calls as requests move (streams/metrics.py implements them for Prometheus)."""
from __future__ import annotations

from typing import Protocol


class GateMetrics(Protocol):
    def admitted(self, tenant: str, priority: str) -> None: ...

    def released(self, tenant: str, priority: str, wait_s: float, hop_s: float) -> None: ...

    def placed(self, model: str, worker: str | None, reason: str, loads_adapter: bool = False) -> None: ...

    def shed(self, tenant: str, reason: str) -> None: ...

    def rejected(self, tenant: str, code: str) -> None: ...

    def cancelled(self, tenant: str) -> None: ...

    def preempted(self, tenant: str, reason: str) -> None: ...

    def tenant_ttft(self, tenant: str, seconds: float) -> None: ...


class NullMetrics:
    """A gate without metrics (tests, tools): every hook does nothing."""

    def admitted(self, tenant: str, priority: str) -> None:
        pass

    def released(self, tenant: str, priority: str, wait_s: float, hop_s: float) -> None:
        pass

    def placed(self, model: str, worker: str | None, reason: str, loads_adapter: bool = False) -> None:
        pass

    def shed(self, tenant: str, reason: str) -> None:
        pass

    def rejected(self, tenant: str, code: str) -> None:
        pass

    def cancelled(self, tenant: str) -> None:
        pass

    def preempted(self, tenant: str, reason: str) -> None:
        pass

    def tenant_ttft(self, tenant: str, seconds: float) -> None:
        pass
