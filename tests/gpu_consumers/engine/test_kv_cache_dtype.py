"""A KV cache in 16 bits beside float32 weights: half the bytes per block, attention still in float32,
the compiled paged kernel and the eager path agree on it, and the logits stay close to float32's."""
import pytest
import torch

from gpu_consumers.engine import Engine, SamplingParams
from gpu_consumers.engine.attention.paged_decode import compiled_decode_attention
from gpu_consumers.engine.model.llama import LlamaForCausalLM


@pytest.mark.parametrize("kv_dtype", [torch.float16, torch.bfloat16])
def test_a_16_bit_kv_cache_halves_the_blocks_bytes_and_keeps_the_logits_close(tok_model_dir, kv_dtype):
    full = LlamaForCausalLM.from_pretrained(tok_model_dir)
    half = LlamaForCausalLM.from_pretrained(tok_model_dir, kv_cache_dtype=kv_dtype)
    assert half.kv_bytes_per_block(16) * 2 == full.kv_bytes_per_block(16)
    assert all(c.dtype == kv_dtype for c in half.allocate_kv_cache(4, 16))
    ids = list(range(3, 120))
    exact, approx = full.sequence_logits(ids), half.sequence_logits(ids)
    assert approx.dtype == torch.float32
    assert not torch.equal(exact, approx)  # the cache really is rounded
    torch.testing.assert_close(approx, exact, rtol=0, atol=0.05 * exact.abs().max().item())


def test_the_compiled_kernel_and_the_eager_path_decode_a_float16_cache_alike(tok_model_dir):
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = ["the quick brown fox", "numbers 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20"]
    compiled = Engine.from_pretrained(tok_model_dir, kv_cache_dtype=torch.float16, num_kv_blocks=64)
    compiled.warmup()
    assert compiled_decode_attention.failed is None
    eager = Engine.from_pretrained(tok_model_dir, kv_cache_dtype=torch.float16, num_kv_blocks=64,
                                   compile_decode=False)
    assert ([r.token_ids for r in compiled.generate(prompts, params)]
            == [r.token_ids for r in eager.generate(prompts, params)])


def test_an_unknown_kv_cache_dtype_is_refused(tok_model_dir):
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        LlamaForCausalLM.from_pretrained(tok_model_dir, kv_cache_dtype=torch.int8)
