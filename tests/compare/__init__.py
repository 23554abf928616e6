"""Tests of nbtrain/compare/."""
