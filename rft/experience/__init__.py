"""What the trainer does to experience groups between the feed and a step: the experience operators
(`trainer.operators`) and the replay priorities (`replay_buffer.priority`)."""
