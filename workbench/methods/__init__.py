"""Federated methods. Each one is a `FederatedMethod` (server half) with its `ClientHalf`, in a file of its own."""
from workbench.methods.afl import AFL
from workbench.methods.anapfl import AnaPFL
from workbench.methods.base import ClientHalf, Cohort, FederatedMethod, Problem, RoundPlan, Upload
from workbench.methods.deepafl import DeepAFL
from workbench.methods.ditto import Ditto
from workbench.methods.fed3r import Fed3R
from workbench.methods.fedavg import FedAvg, FedProx
from workbench.methods.fedavgm import FedAvgM
from workbench.methods.fedncm import FedNCM
from workbench.methods.fedopt import FedAdagrad, FedAdam, FedYogi
from workbench.methods.ghofl import GHOFL
from workbench.methods.local_only import LocalOnly
from workbench.methods.osfed import OSFED
from workbench.methods.safle import SAFLe
from workbench.methods.scaffold import SCAFFOLD

__all__ = ["AFL", "GHOFL", "OSFED", "SCAFFOLD", "AnaPFL", "ClientHalf", "Cohort", "DeepAFL", "Ditto", "Fed3R",
           "FedAdagrad", "FedAdam", "FedAvg", "FedAvgM", "FedNCM", "FedProx", "FedYogi", "FederatedMethod", "LocalOnly",
           "Problem", "RoundPlan", "SAFLe", "Upload"]
