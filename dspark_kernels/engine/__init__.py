"""Serving engine: the SPS (steps/s) profile, verify-length policies, the continuous-batching engine, replay."""

from .engine import Engine, run_closed_loop
from .policies import POLICY_NAMES, make_policy
from .sps import SPSProfile, analytic_roofline, load_profile, profile_path, profile_target, read_profile

__all__ = ["POLICY_NAMES", "Engine", "SPSProfile", "analytic_roofline", "load_profile", "make_policy",
           "profile_path", "profile_target", "read_profile", "run_closed_loop"]
