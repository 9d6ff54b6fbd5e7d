"""What a request asks for: sampling, pooling, structured outputs, a LoRA adapter. Plain data
every layer may read."""
