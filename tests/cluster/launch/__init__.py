"""Tests of nbtrain/cluster/launch/."""
