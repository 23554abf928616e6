"""Tests of nbtrain/data/."""
