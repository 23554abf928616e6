"""Tests of nbtrain/cluster/scaling/."""
