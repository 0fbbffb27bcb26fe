"""Tests for erase_tune.measure."""
