"""Choosing each row's next token: samplers and logits processors, grammar compilation, constraints applied in the batch."""
