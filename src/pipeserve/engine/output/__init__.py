"""The output side of a request: events handed across threads, the consumer stream, per-request output state, detokenization."""
