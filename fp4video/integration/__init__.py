"""diffusers integration: FP4 attention processors, precision policies, install/uninstall."""

from .install import annotate, install, installed_context, uninstall
from .linear import LinearPolicy, install_linear, plan_linear, uninstall_linear
from .policy import Policy, Rule, StepRange
from .processor import AttentionContext, FP4Processor

__all__ = ["FP4Processor", "AttentionContext", "Policy", "Rule", "StepRange", "install", "uninstall", "annotate",
           "installed_context", "LinearPolicy", "install_linear", "uninstall_linear", "plan_linear"]
