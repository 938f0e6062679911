"""Checkpoint I/O: streaming safetensors shard writing and header reading (see safetensors_io)."""
