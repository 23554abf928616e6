"""Tests of nbtrain/server/."""
