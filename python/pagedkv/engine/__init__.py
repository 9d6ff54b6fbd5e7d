"""The engine: requests in, outputs out, one scheduler step at a time over the runner."""
