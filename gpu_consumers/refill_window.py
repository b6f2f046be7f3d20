"""How long a busy worker waits for new work before its next engine step.

A request can join the batch only between steps, and a step on a CPU lasts 60 ms to a second.
When a step ends requests, their slots are usually filled again within one trip round the
platform: the client that got its last token sends its next request, or streams releases a
queued one on the worker's new advert. Both arrive a few tens of milliseconds later, just after
the next step began, and then wait that whole step. Measured under closed-loop load (concurrency
16, 2048-token steps) that wait was the platform's largest addition to time to first token
(docs/serving.md).

So after a step that ended k requests, the worker waits up to `max_wait_s` for k new ones (fewer
when it has less room) before stepping; it steps as soon as they are there. The price is that
wait, paid by every running stream once per such step, so it is held under a fraction
(`step_fraction`) of the step just run, and there is none after a step shorter than `max_wait_s`:
with millisecond steps (a tiny model, a GPU) a late arrival loses little, and waiting costs the
whole batch its pace (the control-plane benchmark, 2-token answers from a tiny model, fell from
215 to about 150 requests/s with windows of half a step). Where ended slots are not refilled
promptly (open-loop traffic with nothing queued), waiting buys nothing: the window keeps a
moving hit rate and stops waiting while under `min_hit_rate`, trying again every
`probe_every`-th time so it notices when refills come back.
"""
from __future__ import annotations


class RefillWindow:
    def __init__(self, max_wait_s: float = 0.05, step_fraction: float = 0.5, min_hit_rate: float = 0.2,
                 probe_every: int = 8, smoothing: float = 0.1):
        if (max_wait_s < 0 or step_fraction < 0 or not 0 <= min_hit_rate <= 1 or probe_every < 1
                or not 0 < smoothing <= 1):
            raise ValueError("bad refill window settings")
        self.max_wait_s = max_wait_s
        self.step_fraction = step_fraction
        self.min_hit_rate = min_hit_rate
        self.probe_every = probe_every
        self.smoothing = smoothing
        self.hit_rate = 1.0  # assume refills come until seen otherwise
        self._skipped = 0

    def plan(self, ended: int, room: int, step_s: float) -> tuple[int, float]:
        """(arrivals to wait for, longest wait in seconds) before the next step, after a step of
        `step_s` seconds that ended `ended` requests, with `room` slots free now; (0, 0.0): step at once."""
        wait = min(self.max_wait_s, self.step_fraction * step_s)
        if ended <= 0 or room <= 0 or wait <= 0 or step_s < self.max_wait_s:
            return 0, 0.0
        if self.hit_rate < self.min_hit_rate:
            self._skipped += 1
            if self._skipped % self.probe_every:
                return 0, 0.0
        return min(ended, room), wait

    def observe(self, expected: int, arrived: int) -> None:
        """What a window planned for `expected` arrivals got."""
        if expected <= 0:
            return
        hit = 1.0 if arrived > 0 else 0.0
        self.hit_rate += self.smoothing * (hit - self.hit_rate)
        if hit:
            self._skipped = 0
