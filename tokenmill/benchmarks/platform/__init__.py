"""Benchmarks of the services: a running tokenmill over HTTP (serve), or a private stack each starts for
itself (control_plane, fairness, isolation, placement, admission, gate), billing's pipeline, the gate's
placement policy on a simulated pool (lora_placement), per-hop latency and stored-response memory."""
