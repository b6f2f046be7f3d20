"""What the benchmarks share, so that no benchmark imports another: the report, a private stack, the
clients that load it, the workloads' words and the waits for a stack to be ready."""
