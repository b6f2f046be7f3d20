"""The paged decode attention as torch operations, and its torch.compile'd form (the compiled decode backend).

One compiler object serves the process (`compiled_decode_attention`): dynamo keeps the graphs of a function
process-wide, per code object, so engines of one process share them; another compiler object would build
the same graphs again (tens of seconds) and spend dynamo's limit of graphs per function sooner."""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable

import torch
import torch.fx.experimental._config

log = logging.getLogger(__name__)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """Attention of one query token per sequence over its paged context, read through its block table.

    q [D, kv_heads, group, head_dim]; k_cache / v_cache [num_blocks, block_size, kv_heads, head_dim];
    block_tables [D, blocks] (padding entries may name any block: positions >= lens are masked);
    lens [D] context lengths. Returns [D, kv_heads, group, head_dim].

    Written as indexing, products and reductions so that inductor (torch.compile) fuses the block-table
    gather into the score and value reductions: the compiled kernel reads each K/V block where it lies
    in the cache, with no padded per-layer copy of the context. Eagerly it gathers, as the SDPA backend does.
    """
    D, nbk = block_tables.shape
    bs = k_cache.shape[1]
    k = k_cache[block_tables]  # [D, nbk, bs, kvh, hd]
    v = v_cache[block_tables]
    s = (q.unsqueeze(1).unsqueeze(1) * k.unsqueeze(4)).sum(-1) * (q.shape[-1] ** -0.5)  # [D, nbk, bs, kvh, g]
    pos = torch.arange(nbk * bs, device=q.device).view(1, nbk, bs, 1, 1)
    s = s.masked_fill(pos >= lens.view(D, 1, 1, 1, 1), float("-inf"))
    m = s.amax(dim=(1, 2), keepdim=True)
    p = torch.exp(s - m)
    den = p.sum(dim=(1, 2))  # [D, kvh, g]
    o = (p.unsqueeze(-1) * v.unsqueeze(4)).sum(dim=(1, 2))  # [D, kvh, g, hd]
    return o / den.unsqueeze(-1)


class CompiledDecodeAttention:
    """paged_decode_attention under torch.compile (dynamic shapes: one graph serves every batch size and
    context length, with graphs of their own for a batch of one and a context of one block).

    `prepare` builds the graphs for a model's head shape and dtype in a background thread, and until
    they are built every call answers None, i.e. the caller's SDPA path runs: a worker serves from its
    first request while the compile (tens of seconds on a busy 2-core machine) goes on beside it.
    `wait` blocks until the graphs are built (benchmarks, Engine.warmup). A failure to compile (no C++
    compiler, an unsupported backend) is logged once and the eager path is used from then on."""

    def __init__(self) -> None:
        self.fn: Callable[..., torch.Tensor] | None = None
        self.failed: str | None = None
        self.compile_s: float | None = None
        self._ready: set = set()
        self._threads: dict = {}
        self._lock = threading.Lock()

    def _call(self, *args):
        # No duck sizing: a batch or block count that happens to equal another size at the first
        # trace (the cache's K/V dim of 2, the block size) would become a guard, and every later
        # step that breaks it a recompile.
        assert self.fn is not None
        with torch.fx.experimental._config.patch(use_duck_shape=False):
            return self.fn(*args)

    def prepare(self, key: tuple, block_size: int) -> None:
        """Start building the graphs for key = (kv_heads, group, head_dim, query dtype, KV cache dtype, device)."""
        with self._lock:
            if self.failed is not None or key in self._ready or key in self._threads:
                return
            if self.fn is None:
                self.fn = torch.compile(paged_decode_attention, dynamic=True)
            t = threading.Thread(target=self._build, args=(key, block_size), daemon=False,
                                 name="tokenmill-compile-decode")
            self._threads[key] = t
        t.start()

    def _build(self, key: tuple, block_size: int) -> None:
        kvh, g, hd, dtype, kv_dtype, device = key
        t0 = time.perf_counter()
        try:
            # The inputs are made as the engine's are: the cache outside inference mode, as two halves of
            # one tensor, the rest inside. A graph is guarded on its inputs' dispatch keys and on whether K
            # and V are one tensor; warming on one inference-mode tensor for both built four graphs no step
            # used, the steps compiled more, and with a second cache dtype in the process dynamo's limit of
            # 8 graphs was hit and that engine's decode ran the slow eager form (measured 105 vs 65 ms).
            cache = torch.zeros(2, 5, block_size, kvh, hd, dtype=kv_dtype, device=device)
            with torch.inference_mode():
                for D in (1, 3):
                    for nbk in (1, 2):
                        self._call(torch.zeros(D, kvh, g, hd, dtype=dtype, device=device), cache[0], cache[1],
                                   torch.zeros(D, nbk, dtype=torch.long, device=device),
                                   torch.ones(D, dtype=torch.long, device=device))
        except Exception as exc:  # inductor's errors share no base class
            if "interpreter shutdown" in str(exc):
                return  # the process is exiting (the thread is not a daemon: a daemon's C++ threads abort it)
            self.failed = f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:200]}"
            log.warning("compiled paged decode attention unavailable, using the eager path: %s", self.failed)
            return
        self.compile_s = time.perf_counter() - t0
        log.info("compiled paged decode attention in %.1f s", self.compile_s)
        with self._lock:
            self._ready.add(key)

    def wait(self, key: tuple | None = None) -> None:
        for k, t in list(self._threads.items()):
            if key is None or k == key:
                t.join()

    def __call__(self, q, k_cache, v_cache, block_tables, lens, wait: bool = False) -> torch.Tensor | None:
        D, kvh, g, hd = q.shape
        key = (kvh, g, hd, q.dtype, k_cache.dtype, q.device.type)
        if key not in self._ready:
            if self.failed is not None:
                return None
            self.prepare(key, k_cache.shape[1])
            if not wait:
                return None
            self.wait(key)
            if key not in self._ready:
                return None
        try:
            return self._call(q, k_cache, v_cache, block_tables, lens)
        except Exception as exc:
            self.failed = f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:200]}"
            log.warning("compiled paged decode attention failed, using the eager path: %s", self.failed)
            return None


compiled_decode_attention = CompiledDecodeAttention()
