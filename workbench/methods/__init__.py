"""Federated methods. Each one is a `FederatedMethod` in a file of its own."""
from workbench.methods.afl import AFL
from workbench.methods.anapfl import AnaPFL
from workbench.methods.base import ClientBatch, FederatedMethod
from workbench.methods.deepafl import DeepAFL
from workbench.methods.ditto import Ditto
from workbench.methods.fedavg import FedAvg, FedProx
from workbench.methods.ghofl import GHOFL
from workbench.methods.local_only import LocalOnly
from workbench.methods.osfed import OSFED
from workbench.methods.safle import SAFLe

__all__ = ["AFL", "AnaPFL", "LocalOnly", "DeepAFL", "GHOFL", "SAFLe", "FedAvg", "FedProx", "Ditto", "OSFED", "ClientBatch", "FederatedMethod"]
