"""Where a run's claim-checked parts live (rft/transport/claims.py), resolved in this one place for every role: the
trainer, explorers, `rft serve` and its joiner, the task publisher, demonstrations. `run_transport(cfg)` is the
run's Kafka transport with that store: its sinks claim-check what they send, its readers resolve claims."""
from __future__ import annotations

from rft.run.config import Config
from rft.transport import ClaimStore, Transport, connect
from rft.weights.config import S3_SCHEME
from rft.weights.store import store_root

RECORDS_DIR = "records"  # beside the weights: <weight store>/records


def claim_store_location(cfg: Config) -> str:
    """`records.store`, default `<sync.weight_store>/records` (a directory `<run dir>/weights/records` unless the
    weights are on S3: then `s3://BUCKET/PREFIX/records`)."""
    if cfg.records.store:
        return cfg.records.store
    if cfg.sync.weight_store.startswith(S3_SCHEME):
        return f"{cfg.sync.weight_store.rstrip('/')}/{RECORDS_DIR}"
    return str(store_root(cfg.sync, cfg.run_dir) / RECORDS_DIR)


def claim_store(cfg: Config) -> ClaimStore:
    """The run's claim store (nothing is created or contacted until a part is stored or read). An S3 store beside
    the weights uses sync's endpoint and region unless records' name theirs."""
    beside = not cfg.records.store
    return ClaimStore(claim_store_location(cfg), threshold=cfg.records.claim_threshold_bytes,
                      endpoint=cfg.records.s3_endpoint or (cfg.sync.s3_endpoint if beside else ""),
                      region=cfg.records.s3_region or (cfg.sync.s3_region if beside else ""),
                      fetch_retries=cfg.records.fetch_retries, fetch_timeout_s=cfg.records.fetch_timeout_s)


def run_transport(cfg: Config, bootstrap: str | None = None) -> Transport:
    """The run's Kafka transport (at `bootstrap`, default kafka.bootstrap_servers) with its claim store."""
    return connect(cfg.kafka, bootstrap, claims=claim_store(cfg))
