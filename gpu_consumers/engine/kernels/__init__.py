"""The C kernels (csrc/), built on first use, and the object an engine holds them by."""
