"""Weight synchronisation: how the explorers get each version the trainer produces.

Modules: `store` (versioned directories on a shared filesystem: the pull path's medium), `bucket` (the same versions
in an S3 bucket, `sync.weight_store: s3://BUCKET/PREFIX`, for fleets that share no filesystem with the trainer),
`cache` (a host's cache of a bucket's versions: one download per host), `delta` (sparse deltas between versions,
`sync.delta`), `stores` (`open_store`: the store the config names, behind the one `VersionStore` interface), `push`
(the push path's process group and wire protocol), `publisher` (trainer side: `WeightPublisher` delivers each
version, in the order rft.trainer.weights.WeightSync owns), `subscriber` (explorer side: `WeightUpdates` knows the
newest version, `PushMembership` takes part in the push group, `load_newest_weights` reloads an engine).
Announcements travel on the control topic (rft.transport.control).

The publisher lives in the trainer's publishing rank (global rank 0). After each optimizer step s the trainer
streams version s in HF layout (megatron_bridge buckets) to it, and it delivers the version by the configured
path (`sync.method`). Per-stage publishing (pull path, pipeline parallelism): rank 0 opens the version's temporary
directory in the store (`WeightStore.stage`) and broadcasts its name; each pipeline stage's publishing rank (TP rank
0, DP rank 0) gets only its own stage's tensors (gathered over TP, no hop to rank 0) and writes them as its own
shards plus a manifest (`StagePublisher` on later stages, write-behind too, no collectives in its thread); rank 0
writes the first stage's and, before step 1 below, waits for every stage's manifest (a stage that failed, or made
no progress within `sync.timeout_s`, is named in the error), then writes the index over all stages' shards. Every
HF tensor comes from exactly one stage. The push path (its sender is rank 0) and the final HF export funnel every
tensor to rank 0.

Pull (elastic fleets, the default). Version s is written to the weight store, then announced on the control
topic (`Weights`: version, path (a bucket store: its URL), and the trainer's consumed offsets). Ordering contract:
  1. a version directory is complete (written to a temporary name, renamed; in a bucket: every file before the
     manifest) before LATEST points to it, and LATEST is updated before the announcement is sent;
  2. a published version is never rewritten; the store keeps the newest `sync.keep_versions`, so an explorer
     may find an announced version already gone and then takes the newest one (it retries);
  3. an explorer loads the newest version (of the store's LATEST and the announcements, never going back)
     before it joins the tasks consumer group (late joiners generate nothing with old weights), and before
     every batch;
  4. every experience group carries the version that generated it; the trainer, not the explorer, has the
     last word on staleness (it drops and counts what exceeds the bound).
  With `sync.write_behind` (the default) the trainer copies version s to host memory and goes on training while a
  background thread stores and announces it (one version in flight; the publisher's docstring has the rules); it
  waits for that write before it commits a checkpoint and before it announces that it finished (the trainer's side
  of the order: rft.trainer.weights.WeightSync).

Push (fixed fleets: `explorer.replicas` engines of `explorer.tensor_parallel_size` workers). The publisher hosts
a process group (`push`; gloo on CPU, NCCL on GPU) and announces it (`PushGroup`) every few seconds until every
engine worker has joined, at most `sync.timeout_s`. Then, per version:
  1. it announces `WeightsPush` {group_id, version, offsets}, then broadcasts the buckets;
  2. explorers take part between two batches (never during generation), load the tensors in place and ack;
  3. the broadcast returns after every member acked: only then does the trainer start the next step (the
     buffers may be reused), and each explorer resumes generating with the version it just acked.
  If the group cannot be formed in time, or a push fails or times out (an explorer died: a fixed group cannot
  lose a member), the publisher announces `PushAbandoned` and uses the pull path for the rest of the run,
  starting with the version whose push failed; explorers leave the abandoned group and pull. A restarted
  trainer forms a new group (new group_id); explorers leave the old one and join it. Every collective of the
  group waits at most `sync.timeout_s`, on both sides (rft.weights.push: deadline and abort, NCCL settings).

LoRA (`model.lora`): each version is the policy's adapters only, in PEFT's layout (`adapter_config.json`,
`adapter_model.safetensors`), under the same contracts: a store version is that directory (rft.weights.store), a push
sends its config tensor then its tensors (store.PUSHED_ADAPTER_CONFIG); explorers load it as a LoRA adapter beside
the base (vLLM) or merge it on load (transformers) (rft.engine).

Trust: announcements are hints, not instructions (rft.weights.subscriber; docs/operations.md "Trust"). Each version
directory carries a manifest (sizes and SHA-256 of every file, per-stage shards included: rft.weights.store); an
explorer loads only its own store's directory of the announced version, after checking it against the manifest,
and joins only push groups at allowed addresses; what it refuses is logged, counted, and its weights stay.

Tested with in-memory fakes in tests/unit/test_weights_ordering.py; trust in tests/unit/test_weights_trust.py; the wire
protocol over gloo in tests/integration/test_weight_push.py; a push failing in a two-rank trainer in
tests/distributed/test_push_abort.py; the bucket store, its host cache and deltas against rft's object server and moto's
in tests/integration/test_bucket_store.py (deltas alone: tests/unit/test_weight_delta.py; per-stage publishing into a
bucket: tests/distributed/test_stage_publish.py); a fleet that reaches only the broker and a bucket in
tests/e2e/test_bucket_fleet.py.
"""
