"""Tests of nbtrain/cluster/ranks/."""
