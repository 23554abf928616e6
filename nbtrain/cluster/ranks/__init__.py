"""Ranks and where they live: node-major assignment and rank tables, the device plan, rank selections."""
