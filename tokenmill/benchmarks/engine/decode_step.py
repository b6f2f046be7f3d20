"""Benchmark: where one decode step's time goes, and whether compiling the forward shortens it
(issue 35, item 1; docs/benchmarks.md, "A decode step, taken apart").

    tokenmill bench decode-step [--model DIR] [--batch 1] [--prompt 128] [--generated 128]
                                [--variants eager,compiled-layers,compiled-elementwise] [--threads 2] [--json PATH]

projections  the step's matrix products alone, at the batch's rows (every layer's qkv, o, gate+up and
             down, then the head), timed back to back on the model's own weights: the step's floor
             when the weights are streamed from memory. Their bytes over that time is the bandwidth
             the step gets from the machine. Timed twice: by the engine's product (for float32 on CPU
             a C loop at one row, oneDNN at more: gpu_consumers/engine/layers/onednn.py) and by F.linear
             (MKL's GEMM).
eager        the engine as it serves: `--batch` sequences of `--prompt` random tokens, `--generated`
             greedy tokens each; the median decode step after the first few.
compiled-*   the same engine with its forward replaced by one whose pieces around attention are
             compiled by torch.compile (inductor; the attention and the KV-cache writes stay the
             engine's): `compiled-layers` each layer's two blocks with their projections inside,
             `compiled-elementwise` only the norms, rope, SwiGLU and residuals between projections.
             Their tokens are compared with eager's (`same tokens`).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from gpu_consumers.engine.layers import onednn
from gpu_consumers.engine.layers.norm import rms_norm
from gpu_consumers.engine.layers.rotary import rope
from infra.paths import local_dir
from tokenmill.benchmarks.harness.report import machine, table, write_json

VARIANTS = ("eager", "compiled-layers", "compiled-elementwise")
SKIPPED_STEPS = 3  # the first decode steps still warm caches and, compiled, trace


def projection_floor(model, batch: int, repeats: int = 20, linear=None) -> dict:
    """One step's projections alone, on the model's weights, at `batch` rows, by `linear` (default: the
    projections the engine holds, on their weights as the engine holds them, packed for oneDNN where
    it is oneDNN; another `linear` gets them plain)."""
    hidden, inter = model.cfg.hidden_size, model.cfg.intermediate_size
    x, attn, act = torch.randn(batch, hidden), torch.randn(batch, model.q_size), torch.randn(batch, inter)
    held = [[L.qkv, L.o, L.gate_up, L.down] for L in model.layers]
    if linear is None:
        layers, head = held, model.lm_head
    else:
        def plain_product(proj):
            w = onednn.plain(proj.weight)
            return lambda rows: linear(rows, w, None)
        layers = [[plain_product(p) for p in L] for L in held]
        head = plain_product(model.lm_head)

    def products() -> None:
        for qkv, o, gate_up, down in layers:
            qkv(x), o(attn), gate_up(x), down(act)
        head(x)

    with torch.inference_mode():
        for _ in range(3):
            products()
        began = time.perf_counter()
        for _ in range(repeats):
            products()
        seconds = (time.perf_counter() - began) / repeats
    weights = [p.weight for L in held for p in L] + [model.lm_head.weight]
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    return {"step_ms": seconds * 1e3, "weight_mb": nbytes / 1e6, "gb_per_s": nbytes / seconds / 1e9}


def _split_rope(model, qkv, cos, sin):
    """q, k rotated and v, as [T, heads, head_dim], from one qkv projection."""
    c, T = model.cfg, qkv.shape[0]
    q, k, v = qkv.split([model.q_size, model.kv_size, model.kv_size], -1)
    return (rope(q.view(T, c.num_heads, c.head_dim), cos, sin),
            rope(k.view(T, c.num_kv_heads, c.head_dim), cos, sin), v.reshape(T, c.num_kv_heads, c.head_dim))


def _swiglu(gu):
    g, u = gu.chunk(2, -1)
    return F.silu(g) * u


def _plain_layers(model) -> list[dict]:
    """The layers with plain weights: the compiled variants multiply by F.linear, which takes no packed ones."""
    return [{"in_norm": L.in_norm, "post_norm": L.post_norm, "qkv_w": onednn.plain(L.qkv.weight),
             "o_w": onednn.plain(L.o.weight), "gu_w": onednn.plain(L.gate_up.weight),
             "down_w": onednn.plain(L.down.weight)} for L in model.layers]


def _norm(model):
    """The model's RMSNorm as a function of (x, weight)."""
    eps = model.cfg.rms_norm_eps
    return lambda x, w: rms_norm(x, w, eps)


def _layers_forward(model):
    """Each layer as two compiled blocks (norm, qkv, rope | o, residual, norm, SwiGLU MLP, residual)."""
    layers = _plain_layers(model)

    def before_attention(h, in_norm, qkv_w, cos, sin):
        return _split_rope(model, F.linear(_norm(model)(h, in_norm), qkv_w), cos, sin)

    def after_attention(h, attn, o_w, post_norm, gu_w, down_w):
        h = h + F.linear(attn.view(h.shape[0], -1), o_w)
        return h + F.linear(_swiglu(F.linear(_norm(model)(h, post_norm), gu_w)), down_w)

    first, second = torch.compile(before_attention, dynamic=True), torch.compile(after_attention, dynamic=True)

    def forward(input_ids, positions, meta, kv_caches, lora=None):
        cos, sin = model.cos[positions].unsqueeze(1), model.sin[positions].unsqueeze(1)
        h = F.embedding(input_ids, model.embed)
        for li, L in enumerate(layers):
            q, k, v = first(h, L["in_norm"], L["qkv_w"], cos, sin)
            attn = model.attention.store_and_attend(q, k, v, kv_caches[li], meta)
            h = second(h, attn, L["o_w"], L["post_norm"], L["gu_w"], L["down_w"])
        return _norm(model)(h, model.norm)
    return forward


def _elementwise_forward(model):
    """Projections eager; what lies between two of them one compiled function each."""
    layers = _plain_layers(model)

    def split_rope(qkv, cos, sin):
        return _split_rope(model, qkv, cos, sin)

    def add_norm(h, delta, w):
        h = h + delta
        return h, _norm(model)(h, w)

    rope_c, add_norm_c, swiglu_c, norm_c = (torch.compile(f, dynamic=True)
                                            for f in (split_rope, add_norm, _swiglu, _norm(model)))

    def forward(input_ids, positions, meta, kv_caches, lora=None):
        cos, sin = model.cos[positions].unsqueeze(1), model.sin[positions].unsqueeze(1)
        h = F.embedding(input_ids, model.embed)
        x = norm_c(h, layers[0]["in_norm"])
        for li, L in enumerate(layers):
            q, k, v = rope_c(F.linear(x, L["qkv_w"]), cos, sin)
            attn = model.attention.store_and_attend(q, k, v, kv_caches[li], meta)
            h, x = add_norm_c(h, F.linear(attn.view(h.shape[0], -1), L["o_w"]), L["post_norm"])
            following = layers[li + 1]["in_norm"] if li + 1 < len(layers) else model.norm
            h, x = add_norm_c(h, F.linear(swiglu_c(F.linear(x, L["gu_w"])), L["down_w"]), following)
        return x
    return forward


FORWARDS = {"compiled-layers": _layers_forward, "compiled-elementwise": _elementwise_forward}


def run_variant(model_dir: str, variant: str, batch: int, prompt: int, generated: int, seed: int) -> dict:
    from gpu_consumers.engine import Engine, SamplingParams

    engine = Engine.from_pretrained(model_dir, dtype=torch.float32, max_num_seqs=max(batch, 1),
                                    max_num_batched_tokens=max(2048, batch))
    if variant != "eager":
        # this engine's model instance only, not its class: the variant stands in for the forward it serves with
        setattr(engine.model, "forward", FORWARDS[variant](engine.model))
    began = time.perf_counter()
    engine.warmup()
    warmup_s = time.perf_counter() - began
    vocab = engine.model.cfg.vocab_size
    gen = torch.Generator().manual_seed(seed)
    params = SamplingParams(max_tokens=generated, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"s{i}", torch.randint(0, vocab, (prompt,), generator=gen).tolist(), params)
    tokens: dict[str, list[int]] = {f"s{i}": [] for i in range(batch)}
    steps = []
    while engine.has_unfinished_requests():
        # a decode step: every sequence had its first token (from its prefill) before it began
        all_started = all(tokens.values())
        t = time.perf_counter()
        outputs = engine.step()
        steps.append((time.perf_counter() - t, engine.runner.last_forward_s, all_started and len(outputs) == batch))
        for out in outputs:
            tokens[out.request_id].extend(out.new_token_ids)
    decode = [s for s in steps if s[2]][SKIPPED_STEPS:]
    step_s = statistics.median(s[0] for s in decode)
    return {"variant": variant, "batch": batch, "warmup_s": warmup_s, "step_ms": step_s * 1e3,
            "forward_ms": statistics.median(s[1] for s in decode) * 1e3, "tg_tok_per_s": batch / step_s,
            "decode_steps": len(decode), "tokens": [tokens[f"s{i}"] for i in range(batch)]}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="tokenmill bench decode-step", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(local_dir() / "models" / "smollm2-135m-instruct"))
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--generated", type=int, default=128)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=str(local_dir() / "bench" / "decode-step.json"))
    args = ap.parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        ap.error(f"unknown variants {sorted(unknown)}; choose from {', '.join(VARIANTS)}")
    torch.set_num_threads(args.threads)

    from gpu_consumers.engine.model.llama import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    floor = projection_floor(model, args.batch)
    by_f_linear = projection_floor(model, args.batch, linear=F.linear)  # MKL's GEMM, what the engine used before
    del model
    rows = [run_variant(args.model, v, args.batch, args.prompt, args.generated, args.seed) for v in variants]
    eager = next((r for r in rows if r["variant"] == "eager"), None)
    for r in rows:
        r["vs_eager"] = eager["step_ms"] / r["step_ms"] if eager else None
        r["same_tokens"] = r["tokens"] == eager["tokens"] if eager else None
        r["beyond_projections_ms"] = r["step_ms"] - floor["step_ms"]
    print(f"B = {args.batch}, {args.threads} threads; projections alone: {floor['step_ms']:.2f} ms a step "
          f"({floor['weight_mb']:.0f} MB at {floor['gb_per_s']:.1f} GB/s); by F.linear: "
          f"{by_f_linear['step_ms']:.2f} ms ({by_f_linear['gb_per_s']:.1f} GB/s)")
    print("\n".join(table(rows, [
        ("variant", -22, "variant", ""), ("step ms", 9, "step_ms", ".2f"), ("forward ms", 11, "forward_ms", ".2f"),
        ("beyond proj. ms", 16, "beyond_projections_ms", ".2f"), ("TG tok/s", 9, "tg_tok_per_s", ".1f"),
        ("vs eager", 9, "vs_eager", ".2f"), ("same tokens", 12, "same_tokens", ""),
        ("warm-up s", 10, "warmup_s", ".1f")])))
    result = {"machine": machine(), "threads": args.threads, "batch": args.batch, "prompt": args.prompt,
              "generated": args.generated, "projections": floor, "projections_by_f_linear": by_f_linear,
              "rows": [{k: v for k, v in r.items() if k != "tokens"} for r in rows]}
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
