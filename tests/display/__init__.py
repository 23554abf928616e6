"""Tests of nbtrain/display/."""
