"""Tests of nbtrain/cluster/."""
