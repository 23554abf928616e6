"""Tests of nbtrain/telemetry/."""
