"""KV-cache rows of a decoding batch (keep, extract, trim, roll), the prefix cache across requests, and the quantized batch cache."""
