"""Tests of nbtrain/engine/."""
