"""Tests of nbtrain/engine/signals/."""
