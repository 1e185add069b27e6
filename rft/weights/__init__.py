"""Weight synchronisation: how the explorers get each version the trainer produces.

Modules: `store` (versioned directories on a shared filesystem: the pull path's medium), `bucket` (the same versions
in an S3 bucket, `sync.weight_store: s3://BUCKET/PREFIX`), `cache` (a host's cache of a bucket's versions),
`delta` (sparse deltas between versions, `sync.delta`), `stores` (`open_store`: the configured store behind the
one `VersionStore` interface), `push` (the push path's process group and wire protocol), `vllm_transfer` (push over
vLLM's NCCL weight transfer), `publisher` (trainer side: `WeightPublisher` delivers each version, in the order
`rft.trainer.weights.WeightSync` owns), `subscriber`
(explorer side: `WeightUpdates`, `PushMembership`, `load_newest_weights`). Announcements travel on the control
topic (rft.transport.control).

Contract (docs/architecture.md, "Weight synchronisation"): after step s the trainer's publishing rank delivers
version s in HF layout (per pipeline stage on the pull path: `WeightStore.stage`, `StagePublisher`).
Pull: a version is complete before LATEST names it, LATEST moves before the announcement, a published version is
never rewritten, an explorer loads the newest version before joining the tasks group and before every batch.
Push (fixed fleets): announce, broadcast, ack; the trainer's next step starts only after every member acked; any
failure announces `PushAbandoned` and the pull path serves the rest of the run. Every group carries its version and
the trainer has the last word on staleness. LoRA versions are PEFT adapter directories under the same contracts.
Trust: announcements are hints; an explorer loads only its own store's directory, checked against the manifest.
"""
