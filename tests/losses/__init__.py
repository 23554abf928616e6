"""Tests of nbtrain/losses/."""
