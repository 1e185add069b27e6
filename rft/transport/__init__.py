"""Records between rft's processes, behind two protocols: `RecordSink` (produce) and `RecordSource` (consume).

This package states the delivery contract and holds the plain values that cross it; it imports no Kafka.
- `rft.transport.kafka`: the Kafka implementations (the only module of rft that imports kafka-python).
- `rft.transport.memory`: in-memory implementations of the same protocols, for unit tests of the trainer and
  explorer loops without a broker.
- `rft.transport.claims`: the claim-check: large parts of records in an object store, claims on the topic;
  `rft.transport.collect`: deleting those parts by retention or once every reader is past them.
A process builds its clients from one `Transport` (`connect(kafka_cfg)` for Kafka, `MemoryTransport()` in
tests) and passes it, or the clients, down.

Positions are plain `"topic:partition" -> offset` maps everywhere ("next offset to read"), so that they can be
stored in JSON checkpoints; no kafka-python object leaves `rft.transport.kafka`.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from rft.transport.base import (
    HEADER_ORIGIN,
    Admin,
    BrokerUnreachable,
    ClaimStoreUnavailable,
    DeadLetter,
    Message,
    PartitionInfo,
    Position,
    PositionSpecError,
    RecordMetadata,
    RecordSink,
    RecordSource,
    RecordTooLarge,
    SendFuture,
    SinkBase,
    SourceBase,
    Transport,
    TransportError,
    lag,
    offset_key,
    parse_offset_key,
    parse_positions,
    parse_time_ms,
    probe_bootstrap,
    record_size,
    resolve_claims,
)
from rft.transport.claims import Claim, ClaimStore, ClaimStoreError, check_in, check_out, claims_in

if TYPE_CHECKING:
    from rft.transport.config import KafkaConfig

__all__ = ["HEADER_ORIGIN", "Admin", "BrokerUnreachable", "Claim", "ClaimStore", "ClaimStoreError",
           "ClaimStoreUnavailable", "DeadLetter", "Message", "PartitionInfo", "Position", "PositionSpecError",
           "RecordMetadata", "RecordSink",
           "RecordSource", "RecordTooLarge", "SendFuture", "SinkBase", "SourceBase", "Transport", "TransportError",
           "check_in", "check_out", "claims_in", "connect", "lag", "offset_key", "parse_offset_key",
           "parse_positions", "parse_time_ms", "probe_bootstrap", "record_size", "resolve_claims"]


def connect(kafka_cfg: KafkaConfig, bootstrap: str | None = None, *, claims: ClaimStore | None = None) -> Transport:
    """The Kafka transport for `kafka_cfg` (at `bootstrap`, default kafka.bootstrap_servers), claim-checking with
    `claims` (rft.transport.claims; a run's: rft.run.records). Nothing connects until a client is built."""
    # heavy: kafka-python, loaded only by processes that talk to a broker
    from rft.transport.kafka import KafkaTransport

    return KafkaTransport(kafka_cfg, bootstrap or kafka_cfg.bootstrap_servers, claims=claims)
