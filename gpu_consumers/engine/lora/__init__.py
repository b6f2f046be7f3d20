"""LoRA adapters: requests, loading, the stacked slot weights and their LRU manager."""
