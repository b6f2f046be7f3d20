"""Quantization methods and the int8 projections they make."""
