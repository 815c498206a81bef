"""Tests of the methods, one file per method."""
