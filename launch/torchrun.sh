#!/usr/bin/env bash
# Single-node trainer: one process per rank, TP x PP x DP from the config.
#   launch/torchrun.sh CONFIG [--set key=value ...]
# Kafka: kafka.bootstrap_servers from the config, or RFT_KAFKA_BOOTSTRAP in the environment.
set -euo pipefail
config=${1:?usage: launch/torchrun.sh CONFIG [--set key=value ...]}
shift
here=$(cd "$(dirname "$0")/.." && pwd)
rft=${RFT_BIN:-$here/.venv/bin/rft}
python=${RFT_PYTHON:-$here/.venv/bin/python}
nproc=$("$python" -m launch.world_size "$config" "$@")
extra=()
[ -n "${RFT_KAFKA_BOOTSTRAP:-}" ] && extra+=(--set "kafka.bootstrap_servers=$RFT_KAFKA_BOOTSTRAP")
exec "$python" -m torch.distributed.run --standalone --nproc-per-node "$nproc" \
  -m rft.cli trainer "$config" "$@" "${extra[@]}"
