"""The engine proper: Engine, its config, scheduler, KV-cache bookkeeping, sequences and sampling."""
