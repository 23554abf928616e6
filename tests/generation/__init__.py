"""Tests of nbtrain/generation/."""
