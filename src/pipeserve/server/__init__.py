"""HTTP layer: Falcon resources, disconnect detection, metrics."""
