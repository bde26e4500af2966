"""The MLX engine: its thread, the scheduler that plans each step, and the batch generator that runs it."""
