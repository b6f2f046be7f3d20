"""Benchmarks of the services: a running tokenmill over HTTP (serve), or a private stack each starts for
itself (control_plane, fairness, isolation, placement; admission and gate start only the parts they
measure), billing's pipeline, the gate's placement policy on a simulated pool (lora_placement) and the
memory stored responses take (stored_memory). hop_latency is no benchmark of its own: it breaks a
request's TTFT down by hop, for serve and control_plane."""
