"""The model's building blocks: projections that own their weights, norms, rope, the glue between products."""
