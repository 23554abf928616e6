"""Tests of nbtrain/data/examples/."""
