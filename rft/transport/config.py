"""The `kafka` section: the broker, the topics rft creates, record size limits and the clients' timeouts."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from rft.config import COUNT, POSITIVE, Section, at_least, option


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
    max_record_bytes: int = option(8 * 1024 * 1024, range=COUNT,
        help="largest record a part sends (bytes): a bigger one (e.g. a group) is refused with its size and "
        "dead-lettered; the consumers' fetch sizes follow it; the broker must accept as much")
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
    """The `records` section: how large parts of a record leave it for the claim store (claim-check)."""
    KEY = "records"
    claim_threshold_bytes: int = option(131072, range=at_least(0, "0: never claim-check"),
        help="a binary part of a record (token ids, log-probs, a routing map's ids) larger than this is stored in "
        "the claim store and replaced in the record by a claim; 0: never")
    store: str = option("",
        help="the claim store: \"\" beside the weights (<sync.weight_store>/records), else a directory or "
        "s3://BUCKET/PREFIX")
