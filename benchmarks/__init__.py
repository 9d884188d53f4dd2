"""Measurement code for jaxckpt: disk limits, peer checkpointers, shared helpers."""
