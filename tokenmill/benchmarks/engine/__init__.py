"""Benchmarks of the model engine alone, in the benchmark's own process (no Kafka, no HTTP): against
transformers and llama.cpp (compare, batched, llamacpp, llama_server), its decode step, LoRA, the quality of
its precisions and structured outputs."""
