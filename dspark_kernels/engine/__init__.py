"""Serving engine: the SPS (steps/s) profile, verify-length policies, the continuous-batching engine, replay.

The step's building blocks (:class:`Sampling`, :func:`prefill`, :class:`PendingContext`, :func:`draft`,
:func:`verify_round`, :func:`features_of`, :func:`finish_reason`) are exported for engines that drive their own loop
(see ``examples/engine_step.py``).
"""

from ..sampling import Sampling
from .engine import Engine, run_closed_loop
from .policies import POLICY_NAMES, make_policy
from .rounds import DRAFT_NOISE_STREAM, PendingContext, draft, features_of, finish_reason, prefill, verify_round

# the SPS names load on first use: importing the package must not import .sps, whose CLI runs as __main__
# (python -m dspark_kernels.engine.sps)
_SPS_NAMES = ("SPSProfile", "analytic_roofline", "load_profile", "profile_path", "profile_target", "read_profile")


def __getattr__(name: str):
    if name in _SPS_NAMES:
        from . import sps

        return getattr(sps, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = ["DRAFT_NOISE_STREAM", "POLICY_NAMES", "Engine", "PendingContext", "SPSProfile", "Sampling",
           "analytic_roofline", "draft", "features_of", "finish_reason", "load_profile", "make_policy", "prefill",
           "profile_path", "profile_target", "read_profile", "run_closed_loop", "verify_round"]
