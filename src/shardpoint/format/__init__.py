"""Byte layouts: safetensors shard files and the checkpoint index."""
