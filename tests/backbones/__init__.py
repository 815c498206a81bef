"""Tests of the backbones."""
