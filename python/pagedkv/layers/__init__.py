"""Model layers, one kind per file."""
