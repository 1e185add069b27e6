"""The `monitor` section: where metrics go (JSONL always; TensorBoard, W&B, Prometheus), progress output, and the
live run page (`rft dashboard`) with its access control."""
from __future__ import annotations

from dataclasses import dataclass

from rft.config import Section, option
from rft.config.fields import PORT_OR_OFF


@dataclass(frozen=True)
class MonitorConfig(Section):
    KEY = "monitor"
    jsonl: bool = option(True,
        help="no effect: metrics always go to `<run dir>/metrics.jsonl` (`rft run`'s progress line and the "
        "dashboard read it)")
    tensorboard: bool = option(False,
        help="also write the metrics as TensorBoard scalars to `<run dir>/tensorboard` (needs tensorboard)")
    wandb: bool = option(False,
        help="also log the trainer's and evaluator's metrics to Weights & Biases (offline unless WANDB_MODE is "
        "set)")
    wandb_project: str = option("rft", help="the W&B project of monitor.wandb")
    prometheus_port: int = option(0, range=PORT_OR_OFF,
        help="0: off; each part serves /metrics on the first free port from here (see rft status)")
    progress: bool = option(True,
        help="print progress: `rft run`'s step line with its ETA, the trainer's line per step, bars for publishing"
        " and evaluating")
    dashboard_port: int = option(0, range=PORT_OR_OFF,
        help="0: off; `rft run` also starts `rft dashboard` on this port (the live run page)")
    prometheus_host: str = option("127.0.0.1",
        help="address the Prometheus endpoints listen on (0.0.0.0: every interface, for a scraper on another host)")
    dashboard_host: str = option("127.0.0.1",
        help="address `rft dashboard` listens on (`--host` overrides); beyond loopback it needs a key "
        "(docs/security.md)")
    dashboard_key_env: str = option("RFT_DASHBOARD_KEY",
        help="environment variable holding the dashboard's bearer key(s) (comma-separated); never written to the "
        "run dir")
    dashboard_key_file: str = option("", help="a file holding dashboard keys, one per line (besides dashboard_key_env)")
    dashboard_allowed_hosts: list[str] = option(factory=list,
        help="Host header values the dashboard accepts (DNS-rebinding defence); empty: loopback names, "
        "dashboard_host and this host's names; [\"*\"]: any")
