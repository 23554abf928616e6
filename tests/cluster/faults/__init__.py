"""Tests of nbtrain/cluster/faults/."""
