"""Speculative decoding: per-row proposals (prompt lookup, prediction, draft model), the width policy, and verification in the batch step."""
