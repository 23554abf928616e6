"""Tests of nbtrain/configs/."""
