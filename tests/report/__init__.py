"""Tests of the comparison page."""
