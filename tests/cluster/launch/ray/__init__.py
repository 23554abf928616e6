"""Tests of nbtrain/cluster/launch/ray/."""
