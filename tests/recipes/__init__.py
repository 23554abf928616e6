"""Tests of nbtrain/recipes/."""
