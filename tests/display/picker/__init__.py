"""Tests of nbtrain/display/picker/."""
