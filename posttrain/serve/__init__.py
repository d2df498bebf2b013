"""Serving a policy: requests decoded by continuous batching over posttrain's decoding engine (scheduler.py)."""
