"""KV-cache rows of a decoding batch (keep, extract, trim, roll) and the prefix cache across requests."""
