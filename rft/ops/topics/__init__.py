"""`rft topics`: an operator tool to list, describe, tail, export and import Kafka topics.

- `cli`: the subcommands and their parser (`rft topics ...`; `main`).
- `formats`: the export file formats (JSONL, decoded JSONL, Parquet) and reading exports back.
- `render`: human views of records (tail lines, decoded exports).
Nothing here is used by the trainer or the explorers: offsets and times are parsed in rft.transport,
run topics are created by rft.transport.run_topics, tokens are detokenized by rft.text.tokens.
"""
from __future__ import annotations


class TopicsError(Exception):
    """A user-facing error; `main` prints it and returns 1."""

