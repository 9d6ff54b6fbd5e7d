"""Helpers the tests of several tiers share (checkpoints, HF parity, servers, adapters)."""
