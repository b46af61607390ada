"""Engine-side pieces of the scheduler: the target's SPS (steps/s) profile."""

from .sps import SPSProfile, analytic_roofline, load_profile, profile_path, profile_target, read_profile

__all__ = ["SPSProfile", "analytic_roofline", "load_profile", "profile_path", "profile_target", "read_profile"]
