"""Tests of :mod:`erase_tune.store`, run against every supported backend."""
