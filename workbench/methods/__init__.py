"""Federated methods. Each one is a `FederatedMethod` (server half) with its `ClientHalf`, in a file of its own."""
from workbench.methods.afl import AFL
from workbench.methods.base import ClientHalf, Cohort, FederatedMethod, Problem, RoundPlan, Upload

__all__ = ["AFL", "ClientHalf", "Cohort", "FederatedMethod", "Problem", "RoundPlan", "Upload"]
