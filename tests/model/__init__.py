"""Tests of nbtrain/model/."""
