"""shardwise core: the InferenceDeployment API, presets, the planner, the cost model and EPLB.

The core imports no kopf, no Kubernetes client and no grpc (a test enforces it).
"""

from shardwise.api import InferenceDeployment, InferenceDeploymentSpec
from shardwise.cost import Phase, Workload
from shardwise.planner import Plan, Violation, plan

__all__ = ["InferenceDeployment", "InferenceDeploymentSpec", "Phase", "Plan", "Violation", "Workload", "plan"]
__version__ = "0.1.0"
