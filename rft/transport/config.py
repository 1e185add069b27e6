"""The `kafka` section: the broker, the topics rft creates, record size limits and the clients' timeouts; the `records`
section: where large parts of records go (the claim-check, rft/transport/claims.py) and when they are collected."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from rft.config import COUNT, POSITIVE, Range, Section, SectionError, at_least, option
from rft.weights.config import S3_SCHEME, split_s3_url


@dataclass(frozen=True)
class KafkaConfig(Section):
    KEY = "kafka"
    bootstrap_servers: str = option("embedded",
        help="the broker: host:port[,host:port...]; embedded: `rft run` starts a local broker for the run (the "
        "other commands then need the real address, --set kafka.bootstrap_servers=HOST:PORT)")
    embedded_data_dir: str = option("",
        help="embedded broker only: \"\" in memory; a directory (relative: under the run dir) keeps topics across a "
        "crash")
    topic_prefix: str = option("", help="empty: the run name")
    partitions: int = option(4, range=COUNT,
        help="tasks and control topics (explorers share the tasks topic by partitions)")
    experience_partitions: int = option(1, range=COUNT,
        help="1 keeps the trainer's batches identical across restarts (see trainer/feed.py)")
    replication_factor: int = option(1, range=COUNT,
        help="replicas of each topic rft creates (3 on a production cluster, docs/operations.md); topics that "
        "exist keep theirs")
    max_record_bytes: int = option(1_000_000, range=COUNT,
        help="largest record a part sends (bytes; 1000000 fits a default Kafka broker, message.max.bytes 1048588): "
        "a bigger one has its large parts, else its whole body, claim-checked (records.claim_threshold_bytes), or "
        "with the claim-check off is refused with its size and dead-lettered; the consumers' fetch sizes follow it; "
        "the broker must accept as much plus ~100 bytes of batch framing")
    compression: Literal["gzip", "snappy", "lz4", "zstd"] | None = option("zstd",
        help="codec the producers compress record batches with (consumers need nothing); null: none. zstd, "
        "measured (`rft bench compression`, docs/benchmarks.md): the flagship's groups 3.1x smaller on the wire, "
        "long traces 1.7x, routing maps 1.3x, for 0.05-10 ms of CPU a group; lz4 1.05-2.7x, gzip as small at 2-20x "
        "zstd's CPU")
    request_timeout_ms: int = option(30000, range=POSITIVE,
        help="the Kafka clients' request timeout; also how long a part waits for the broker to acknowledge a "
        "record it sent")
    session_timeout_ms: int = option(6000, range=POSITIVE,
        help="a consumer-group member silent this long is presumed dead and its partitions move to the others "
        "(heartbeats every quarter of it, at least 500 ms)")
    max_poll_interval_ms: int = option(5000, range=POSITIVE,
        help="longest a consumer-group member may go between two polls before the group presumes it dead (an "
        "explorer uses at least explorer.max_batch_s)")
    security: dict[str, Any] = option(factory=dict, help="passed to kafka clients verbatim")


@dataclass(frozen=True)
class RecordsConfig(Section):
    """The claim-check (rft/transport/claims.py, docs/schema.md "Claim-checked parts"): large binary parts of records
    go to an object store, the record carries their SHA-256 and size."""
    KEY = "records"
    claim_threshold_bytes: int = option(131072, range=at_least(0, "0: never claim-check"),
        help="a binary part of a record (token ids, log-probs, a routing map's ids) larger than this many bytes is "
        "stored in the claim store and replaced in the record by a claim (its SHA-256 and size); a record still "
        "over kafka.max_record_bytes then has its whole body claim-checked; 0: never (a record over the limit is "
        "refused as too large)")
    store: str = option("",
        help="the claim store: a directory every part sees, or s3://BUCKET/PREFIX; empty: beside the weights "
        "(<sync.weight_store>/records: <run dir>/weights/records by default, or s3://BUCKET/PREFIX/records when the "
        "weights are on S3)")
    s3_endpoint: str = option("",
        help="s3:// claim store: the S3 endpoint URL (empty: sync.s3_endpoint when records.store is empty, else "
        "AWS_ENDPOINT_URL, else AWS's); http:// only to a loopback host unless sync.s3_allow_http")
    s3_region: str = option("",
        help="s3:// claim store: the bucket's region (empty: sync.s3_region when records.store is empty, else "
        "AWS_REGION, else us-east-1)")
    collect: Literal["retention", "committed"] = option("retention",
        help="when stored parts are deleted (docs/operations.md, \"Collecting claim-checked parts\"): retention "
        "(records.retention_hours after they were last written; the trainer sweeps, and `rft records collect`) or "
        "committed (once the trainer's checkpoint and every consumer group of records.readers are past every "
        "record of the experiences topic that names them; the trainer collects after its checkpoints; an offline "
        "replay of the topic later finds those parts gone)")
    retention_hours: float = option(168.0, range=Range(0, 1e6, low_open=True),
        help="collect retention: hours a stored part is kept after it was last written (a re-put of the same "
        "part starts them again; keep it at least the experiences topic's retention, so that an offline replay of "
        "the topic finds its parts)")
    readers: list[str] = option(factory=list,
        help="collect committed: consumer groups that, besides the trainer, must commit past a record of the "
        "experiences topic before its parts are deleted (e.g. an offline reader of the topic); a group that "
        "committed nothing holds collection back")
    fetch_retries: int = option(3, range=at_least(0, "0: report the first error"),
        help="a claim-store read or write that fails transiently (a timeout, a refused or dropped connection, a "
        "5xx) is tried this many more times, 0.5, 1, 2... s apart (at most 5 s), before the group is "
        "dead-lettered (read) or not sent (write); a missing object or a checksum mismatch is never retried")
    fetch_timeout_s: float = option(10.0, range=Range(0, 3600, low_open=True),
        help="s3:// claim store: the longest one attempt to read or write a part may take (connect included); "
        "a group's read costs at most (1 + fetch_retries) x this plus the pauses")

    def validate(self) -> None:
        if self.store.startswith(S3_SCHEME):
            try:
                split_s3_url(self.store)
            except ValueError as e:
                raise SectionError("store", str(e)) from None
        if any(not isinstance(r, str) or not r for r in self.readers):
            raise SectionError("readers", f"must be non-empty consumer-group names, got {self.readers!r}")
