"""Every benchmark (`tokenmill bench <name>`): each prints a table and writes JSON, and reports the
machine it ran on.

    harness/   what the benchmarks share: the report (one percentile definition, the machine, the JSON
               file), a private stack to measure, the clients that load it, workloads, waiting for readiness
    engine/    the model engine alone, in this process: against transformers and llama.cpp, its decode
               step, LoRA, quality of its precisions, structured outputs
    platform/  the services over HTTP and Kafka: serving, the gate, the control plane, fairness, admission,
               isolation, placement, billing, stored-response memory (and the per-hop TTFT breakdown)

A benchmark with a `main(argv)` runs as `python -m <its module>`, and those in BENCHES as `tokenmill bench <name>`;
the others (batched, structured, the llama.cpp peers) are parts of one of those.
"""

# `tokenmill bench <name>` -> the module whose main(argv) it runs
BENCHES = {"engine": "tokenmill.benchmarks.engine.compare", "billing": "tokenmill.benchmarks.platform.billing",
           "serve": "tokenmill.benchmarks.platform.serve", "admission": "tokenmill.benchmarks.platform.admission",
           "fairness": "tokenmill.benchmarks.platform.fairness",
           "control-plane": "tokenmill.benchmarks.platform.control_plane",
           "gate": "tokenmill.benchmarks.platform.gate", "placement": "tokenmill.benchmarks.platform.placement",
           "lora": "tokenmill.benchmarks.engine.lora", "lora-placement": "tokenmill.benchmarks.platform.lora_placement",
           "isolation": "tokenmill.benchmarks.platform.isolation", "quality": "tokenmill.benchmarks.engine.quality",
           "stored-memory": "tokenmill.benchmarks.platform.stored_memory",
           "decode-step": "tokenmill.benchmarks.engine.decode_step"}
