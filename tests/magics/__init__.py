"""Tests of nbtrain/magics/."""
