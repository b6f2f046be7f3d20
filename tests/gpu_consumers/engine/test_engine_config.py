"""EngineConfig holds every setting, and what runs is chosen from it once, when the model loads: the
decode attention backend, the operations between the products, each projection's kind."""
from __future__ import annotations

import pytest
import torch

from gpu_consumers.engine import Engine, EngineConfig
from gpu_consumers.engine.attention.decode_backends import CompiledDecode, NativeDecode, SdpaDecode
from gpu_consumers.engine.kernels.native_decode_attention import NativeDecodeAttention
from gpu_consumers.engine.layers.glue import NativeGlue, TorchGlue
from gpu_consumers.engine.layers.linear import OneDnnLinear, TorchLinear
from gpu_consumers.engine.layers.onednn import for_weights, onednn_linear
from gpu_consumers.engine.model.llama import LlamaForCausalLM

ONEDNN = for_weights(torch.float32, torch.device("cpu")) is onednn_linear


def test_settings_outside_their_range_are_refused():
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype=torch.int8)
    with pytest.raises(ValueError, match="quantization"):
        EngineConfig(quantization="int4")


def test_the_decode_backend_follows_the_config(model_dirs, monkeypatch):
    path = model_dirs["llama-gqa-rope3"]
    assert type(LlamaForCausalLM.from_pretrained(path).attention.decode) is NativeDecode  # the CPU default
    assert type(LlamaForCausalLM.from_pretrained(path, compile_decode=False).attention.decode) is SdpaDecode
    monkeypatch.setattr(NativeDecodeAttention, "applies", lambda *a: False)
    assert type(LlamaForCausalLM.from_pretrained(path).attention.decode) is CompiledDecode


def test_the_glue_and_the_products_follow_the_config(model_dirs):
    path = model_dirs["llama-tied"]
    default = LlamaForCausalLM.from_pretrained(path)
    assert type(default.glue) is NativeGlue
    assert type(default.layers[0].down) is (OneDnnLinear if ONEDNN else TorchLinear)
    plain = LlamaForCausalLM.from_pretrained(path, native_layer_ops=False, use_onednn=False)
    assert type(plain.glue) is TorchGlue and type(plain.layers[0].down) is TorchLinear
    assert type(LlamaForCausalLM.from_pretrained(path, dtype=torch.bfloat16).glue) is TorchGlue


def test_an_engine_takes_its_model_settings_from_the_model(model_dirs):
    model = LlamaForCausalLM.from_pretrained(model_dirs["llama-tied"], compile_decode=False)
    engine = Engine(model, num_kv_blocks=16)
    assert engine.config.compile_decode is False and not engine.runner.compile_decode
    with pytest.raises(ValueError, match="loaded as"):
        Engine(model, config=EngineConfig(dtype=torch.bfloat16), num_kv_blocks=16)
