"""Edge admission: the cheap, local quota check before anything is queued.

Until token quotas land this only tracks what is in flight, so the rest of ingress
already calls admit/release at the right places.
"""
from __future__ import annotations

from dataclasses import dataclass

from ingress.tenant_directory import Caller


@dataclass
class Reservation:
    tenant_id: str
    tokens: int
    released: bool = False


class EdgeAdmission:
    def __init__(self):
        self.in_flight: dict[str, int] = {}

    def start(self, process_id: str) -> None:
        pass

    def stop(self) -> None:
        pass

    def admit(self, caller: Caller, tokens: int) -> Reservation:
        self.in_flight[caller.tenant_id] = self.in_flight.get(caller.tenant_id, 0) + 1
        return Reservation(caller.tenant_id, tokens)

    def release(self, reservation: Reservation) -> None:
        if reservation.released:
            return
        reservation.released = True
        self.in_flight[reservation.tenant_id] -= 1
