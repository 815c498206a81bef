"""Federated methods. Each one is a `FederatedMethod` in a file of its own."""
from workbench.methods.afl import AFL
from workbench.methods.base import ClientBatch, FederatedMethod

__all__ = ["AFL", "ClientBatch", "FederatedMethod"]
