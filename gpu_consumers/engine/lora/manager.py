"""Which adapters are resident, in which slot; loading on demand; LRU eviction.

An adapter a request names is validated at once (the config and the safetensors header: a few kB read
on the caller's thread, so a bad directory fails the request where it is added) and then read on a
background thread. Between steps the engine calls ``poll``: adapters that finished reading are copied
into a free slot, or into the least recently used slot that no running sequence uses; sequences
wait in the queue until their adapter is resident, and every other sequence keeps stepping meanwhile.
A read that fails is reported by ``poll`` so the engine can end the requests waiting for it.

No owner may keep every slot from the others (an adapter's owner is the part of its id before '/', the
tenant in `<tenant>/<name>@<version>`): an owner may hold more than ``owner_share`` slots (half of them,
at least one) only while nobody else waits. When an adapter of an owner under its share has been read and
every slot serves a running sequence, ``poll`` names the least recently used adapter of an owner over its
share; the engine preempts that adapter's sequences (they resume later by recompute, as under KV pressure)
and the slot goes to the waiting owner.
"""
from __future__ import annotations

from collections import Counter, OrderedDict
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

import torch

from .loader import LoadedAdapter, load_adapter
from .request import LoraRequest
from .slots import LoraBatch, LoraSlots
from formats.adapter_files import AdapterSpec, BaseShapes, LoraLoadError, validate_adapter_dir


def owner_of(adapter_id: str) -> str:
    """Who an adapter belongs to: the part of its id before '/' (the whole id when it has none)."""
    return adapter_id.split("/", 1)[0]


class LoraManager:
    def __init__(self, base: BaseShapes, max_loras: int, max_rank: int, dtype: torch.dtype, device) -> None:
        self.base = base
        self.owner_share = max(1, max_loras // 2)
        self.max_rank = max_rank
        self.dtype = dtype
        self.device = device
        self.slots = LoraSlots(base, max_loras, max_rank, dtype, device)
        self.resident: OrderedDict[str, int] = OrderedDict()  # adapter id -> slot, least recently used first
        self.loading: dict[str, Future] = {}
        self.loaded: dict[str, LoadedAdapter] = {}  # read, waiting for a slot
        # every adapter validated so far, so one evicted while requests still wait for it is read again
        self.specs: dict[str, AdapterSpec] = {}
        self._executor: ThreadPoolExecutor | None = None
        self.num_loads = 0
        self.num_evictions = 0
        self.num_load_failures = 0
        self.num_share_preemptions = 0

    # ----------------------------------------------------------------- queries
    def is_resident(self, adapter_id: str) -> bool:
        return adapter_id in self.resident

    def slot_of(self, adapter_id: str) -> int:
        return self.resident[adapter_id]

    def resident_ids(self) -> list[str]:
        """Resident adapter ids, least recently used first."""
        return list(self.resident)

    @property
    def in_use(self) -> bool:
        """Whether any request has named an adapter yet (before that, the engine skips all of this)."""
        return bool(self.specs)

    # ---------------------------------------------------------------- requests
    def request(self, lora: LoraRequest) -> None:
        """Make sure ``lora`` is resident or on its way; raises LoraLoadError for a directory that
        cannot be served (validated here, on the caller's thread)."""
        aid = lora.adapter_id
        if aid in self.resident or aid in self.loading or aid in self.loaded:
            return
        self.specs[aid] = validate_adapter_dir(lora.path, self.base, self.max_rank)
        self._start_read(aid)

    def _start_read(self, aid: str) -> None:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenmill-lora-load")
        self.loading[aid] = self._executor.submit(self._read, aid, self.specs[aid])

    def _read(self, adapter_id: str, spec: AdapterSpec) -> LoadedAdapter:
        with torch.inference_mode():
            return load_adapter(adapter_id, spec, self.dtype, self.device)

    def wait(self, timeout: float) -> None:
        """Block until a read in flight ends, at most ``timeout`` seconds (when nothing else can run)."""
        if self.loading:
            wait(list(self.loading.values()), timeout=timeout, return_when=FIRST_COMPLETED)

    # ------------------------------------------------------------ between steps
    def poll(self, pinned: set[str], wanted: set[str]) -> tuple[dict[str, str], str | None]:
        """Install what finished reading (only adapters still ``wanted`` by a queued or running
        sequence), evicting LRU adapters that no running sequence uses (``pinned``). Returns
        ({adapter id: error message} for reads that failed, a resident adapter whose running sequences
        the engine should preempt so that an owner under its share gets a slot, or None). A wanted
        adapter that is nowhere (evicted while a preempted or queued sequence still needed it) is read again."""
        for aid in wanted:
            if aid not in self.resident and aid not in self.loading and aid not in self.loaded:
                self._start_read(aid)
        failed: dict[str, str] = {}
        for aid, fut in list(self.loading.items()):
            if not fut.done():
                continue
            del self.loading[aid]
            exc = fut.exception()
            if exc is None:
                self.loaded[aid] = fut.result()
            else:
                self.num_load_failures += 1
                failed[aid] = str(exc) if isinstance(exc, LoraLoadError) else (
                    f"adapter {aid!r} could not be loaded: {type(exc).__name__}: {exc}")
        preempt = None
        held = Counter(owner_of(a) for a in self.resident)
        # owners under their share first: a slot freed for one must not go to the owner it was taken from
        for aid in sorted(self.loaded, key=lambda a: held[owner_of(a)] >= self.owner_share):
            if aid not in wanted:
                del self.loaded[aid]  # its requests ended while it was read
                continue
            slot = self._free_slot(pinned, wanted)
            if slot is None:  # every slot serves a running sequence: wait for one to finish, unless
                preempt = preempt or self._over_share_victim(aid)  # an owner keeps more than its share
                continue
            adapter = self.loaded.pop(aid)
            try:
                self.slots.install(slot, adapter)
            except LoraLoadError as exc:  # not finite in the slots' dtype: the slot stays empty
                self.num_load_failures += 1
                failed[aid] = str(exc)
                continue
            self.resident[aid] = slot
            self.num_loads += 1
        return failed, preempt

    def _over_share_victim(self, aid: str) -> str | None:
        """The least recently used adapter of another owner holding more than its share, when ``aid``'s
        owner holds less than its share."""
        held = Counter(owner_of(a) for a in self.resident)
        mine = owner_of(aid)
        if held[mine] >= self.owner_share:
            return None
        victim = next((a for a in self.resident if owner_of(a) != mine and held[owner_of(a)] > self.owner_share), None)
        if victim is not None:
            self.num_share_preemptions += 1
        return victim

    def _free_slot(self, pinned: set[str], wanted: set[str]) -> int | None:
        used = set(self.resident.values())
        for slot in range(self.slots.num_slots):
            if slot not in used:
                return slot
        victims = [a for a in self.resident if a not in pinned]
        if not victims:
            return None
        # least recently used first, but one that no queued sequence waits for before one that some does
        victim = next((a for a in victims if a not in wanted), victims[0])
        slot = self.resident.pop(victim)
        self.slots.clear(slot)
        self.num_evictions += 1
        return slot

    # ------------------------------------------------------------------- steps
    def batch(self, adapter_ids: list[str | None], num_tokens: list[int]) -> LoraBatch | None:
        """The step's LoRA inputs for sequences (in flat batch order) with these adapters and token
        counts; marks their adapters used now (LRU). None when no sequence has an adapter."""
        if not any(adapter_ids):
            return None
        token_slots: list[int] = []
        for aid, n in zip(adapter_ids, num_tokens):
            if aid is None:
                token_slots.extend([-1] * n)
            else:
                self.resident.move_to_end(aid)
                token_slots.extend([self.resident[aid]] * n)
        return self.slots.batch(token_slots)

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
