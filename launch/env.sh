# Sourced by the shell launchers (launch/torchrun.sh, launch/slurm/*.sbatch) after they set RFT_HOME, the rft
# checkout. Sets:
#   rft_python  RFT_PYTHON, else RFT_HOME/.venv/bin/python when it exists, else python3 (with RFT_HOME first on
#               PYTHONPATH, so that the roles run this checkout's code and `-m launch.world_size` resolves)
#   kafka_set   (--set kafka.bootstrap_servers=$RFT_KAFKA_BOOTSTRAP) when RFT_KAFKA_BOOTSTRAP is set, else ()
if [ -n "${RFT_PYTHON:-}" ]; then
  rft_python=$RFT_PYTHON
elif [ -x "$RFT_HOME/.venv/bin/python" ]; then
  rft_python=$RFT_HOME/.venv/bin/python
else
  rft_python=python3
fi
export PYTHONPATH="$RFT_HOME${PYTHONPATH:+:$PYTHONPATH}"
kafka_set=()
if [ -n "${RFT_KAFKA_BOOTSTRAP:-}" ]; then
  kafka_set=(--set "kafka.bootstrap_servers=$RFT_KAFKA_BOOTSTRAP")
fi
