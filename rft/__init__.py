"""rft: reinforcement fine-tuning of LLMs. Megatron-core trainers consume experience groups from Kafka
topics that elastic vLLM explorer fleets fill; a coordinator keeps the explorers' weights fresh."""

__version__ = "0.1.0"
