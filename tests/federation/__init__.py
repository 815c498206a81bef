"""Tests of what crosses the wire: codec, protocol, privacy, secure aggregation."""
