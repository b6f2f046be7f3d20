"""Offline bulk inference: OpenAI Batch-format JSONL files published to `requests`.

A batch is a set of ordinary `InferenceRequested` events with priority `batch`, a
`batch_id`, a `custom_id` and the reply address `batch-results`/<hash(batch id) % 6>.
Results are folded back from that partition with the same `RequestView` ingress uses.

- `ids`: stable ids (batch id, request ids, seeds, result partition)
- `parse`: reading and validating input lines (pure; a tokenizer is passed in)
- `store`: batch manifests and files on local disk (`.local/batches/`)
- `submit`: turning valid lines into events and publishing them
- `collect`: folding `batch-results` (and `usage`, on cancel) into outputs
- `service`: the operations shared by the CLI and HTTP
- `cli`: `tokenmill batch submit|status|collect|cancel`
- `http`: `/v1/files` and `/v1/batches` for the OpenAI SDK
"""
