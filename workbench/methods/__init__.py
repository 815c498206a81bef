"""Federated methods. Each one is a `FederatedMethod` (server half) with its `ClientHalf`, in a file of its own."""
from workbench.methods.afl import AFL
from workbench.methods.fedavg import FedAvg, FedProx
from workbench.methods.base import ClientHalf, Cohort, FederatedMethod, Problem, RoundPlan, Upload

__all__ = ["AFL", "FedAvg", "FedProx", "ClientHalf", "Cohort", "FederatedMethod", "Problem", "RoundPlan", "Upload"]
