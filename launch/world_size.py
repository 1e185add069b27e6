"""Print how many trainer processes to start on each node: tensor x pipeline x data parallel from the config,
divided over `--nodes N` (default 1). Used by the shell launchers so that they never parse YAML themselves.

  python -m launch.world_size CONFIG [--set key=value ...] [--nodes N] [--nproc-per-node P]

With `--nproc-per-node P` (e.g. the GPUs Slurm gave each node) it checks that N x P is the config's world size
and prints P. Other arguments (those meant for `rft trainer`, such as --no-resume) are ignored. Exit 2 with the
reason when the config is invalid or the processes do not fit the nodes."""
import argparse
import sys

from rft.config import ConfigError
from rft.run.config import load_config


def processes_per_node(world_size: int, nodes: int, nproc_per_node: int | None) -> int:
    """The processes each node starts; ValueError naming the mismatch when there is no fit."""
    if nodes < 1:
        raise ValueError(f"the number of nodes must be >= 1, got {nodes}")
    if nproc_per_node is not None:
        if nproc_per_node * nodes != world_size:
            raise ValueError(f"{nodes} node(s) x {nproc_per_node} processes per node = {nproc_per_node * nodes}, "
                             f"but the config's trainer world size (tensor x pipeline x data parallel) is {world_size}")
        return nproc_per_node
    if world_size % nodes:
        raise ValueError(f"the config's trainer world size (tensor x pipeline x data parallel) {world_size} is not "
                         f"divisible by the number of nodes {nodes}")
    return world_size // nodes


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m launch.world_size")
    parser.add_argument("config")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--nproc-per-node", type=int, default=None)
    args, _ = parser.parse_known_args(argv)
    try:
        t = load_config(args.config, args.overrides).trainer
        print(processes_per_node(t.tensor_parallel * t.pipeline_parallel * t.data_parallel, args.nodes,
                                 args.nproc_per_node))
    except ConfigError as e:
        print(f"invalid config: {e}", file=sys.stderr)
        return 2
    except ValueError as e:
        print(f"cannot place the trainer: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
