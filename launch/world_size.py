"""Print the number of trainer processes a config asks for (tensor x pipeline x data parallel); used by the
shell launchers so that they never parse YAML themselves."""
import sys

from rft.config import ConfigError, load_config


def main(argv: list[str]) -> int:
    overrides = [argv[i + 1] for i, a in enumerate(argv) if a == "--set" and i + 1 < len(argv)]
    try:
        t = load_config(argv[0], overrides).trainer
    except ConfigError as e:
        print(f"invalid config: {e}", file=sys.stderr)
        return 2
    print(t.tensor_parallel * t.pipeline_parallel * t.data_parallel)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
