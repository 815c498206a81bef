"""Tests of the data: datasets, partitions, the feature cache, your own data, text."""
