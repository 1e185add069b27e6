#!/usr/bin/env bash
# The trainer's processes on this node, one per rank; TP x PP x DP from the config.
#   launch/torchrun.sh CONFIG [--set key=value ...] [--no-resume]
# One node (default): torchrun --standalone. Several nodes, or a fixed rendezvous (launch/slurm/trainer.sbatch
# sets these and runs this script once per node):
#   RFT_MASTER_ADDR  host of node rank 0 (setting it selects the fixed rendezvous)
#   RFT_MASTER_PORT  its rendezvous port (default 29500)
#   RFT_NNODES       number of nodes (default 1)
#   RFT_NODE_RANK    this node's rank, 0 .. RFT_NNODES-1
# Processes per node: RFT_NPROC_PER_NODE (checked against the config), else TP x PP x DP / RFT_NNODES.
# Kafka: kafka.bootstrap_servers from the config, or RFT_KAFKA_BOOTSTRAP in the environment.
# torchrun is rft.cli.torchrun (torch.distributed.run's arguments): its stores listen only on their host
# (localhost standalone, RFT_MASTER_ADDR otherwise), and a stop by signal ends with one line and 128 + the signal.
set -euo pipefail
config=${1:?usage: launch/torchrun.sh CONFIG [--set key=value ...]}
shift
RFT_HOME=$(cd "$(dirname "$0")/.." && pwd)
source "$RFT_HOME/launch/env.sh"
nnodes=${RFT_NNODES:-1}
nproc=$("$rft_python" -m launch.world_size "$config" --nodes "$nnodes" \
        ${RFT_NPROC_PER_NODE:+--nproc-per-node "$RFT_NPROC_PER_NODE"} "$@")
if [ -n "${RFT_MASTER_ADDR:-}" ]; then
  rendezvous=(--nnodes "$nnodes" --node-rank "${RFT_NODE_RANK:?RFT_NODE_RANK is not set (RFT_MASTER_ADDR is)}"
              --master-addr "$RFT_MASTER_ADDR" --master-port "${RFT_MASTER_PORT:-29500}")
else
  if [ "$nnodes" != 1 ]; then
    echo "launch/torchrun.sh: RFT_NNODES=$nnodes needs RFT_MASTER_ADDR and RFT_NODE_RANK" >&2
    exit 2
  fi
  rendezvous=(--standalone)
fi
exec "$rft_python" -m rft.cli.torchrun "${rendezvous[@]}" --nproc-per-node "$nproc" \
  -m rft.cli trainer "$config" "$@" "${kafka_set[@]}"
