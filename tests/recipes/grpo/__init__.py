"""Tests of nbtrain/recipes/grpo/."""
