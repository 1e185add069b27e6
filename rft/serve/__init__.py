"""Serve mode: `rft serve` (rft/serve/server.py and the modules it names), an OpenAI-compatible endpoint that
records every completion and takes feedback, and the joiner (rft/serve/joiner.py) that turns rewarded completions
into experience groups for the trainer. The records are rft.schema's `ServedCompletion` and `Feedback`
(docs/schema.md)."""
