"""Evaluation: task sets sampled with the explorer's engine and workflow, scored by the rewards, reported as
accuracy, pass@k and mean@k (`metrics`), for checkpoints named on the command line (`checkpoints`) or for the
versions a live run publishes (`main`: `rft eval CONFIG --checkpoint SPEC | --follow`)."""
