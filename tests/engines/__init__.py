"""Tests of the engines: the round, in process, several processes, Flower; the conformance matrix."""
