"""Drafters: what proposes the tokens the target verifies.

* :mod:`.api`: the :class:`Drafter` protocol the decode loops and the engine call, :class:`NullDrafter` (plain
  decoding), and the checkpoint helpers every drafter kind shares;
* :mod:`.block_drafter`: the DSpark / DFlash block drafter (a parallel backbone over target features);
* :mod:`.sequential_head`: its sequential (Markov / RNN) head and confidence head;
* :mod:`.chain_drafter`: the EAGLE-style chain drafter and MTP-1;
* :mod:`.loader`: :func:`load_drafter`, which opens any drafter directory.
"""

from .api import DraftContext, Drafter, DraftOutput, NullDrafter, check_drafter_target, check_gamma
from .block_drafter import MAX_GAMMA, BlockDrafter, DrafterConfig, load_block_drafter
from .chain_drafter import ChainDrafter, ChainDrafterConfig, load_chain_drafter
from .loader import load_drafter
from .sequential_head import SequentialHead

__all__ = [
    "MAX_GAMMA",
    "BlockDrafter",
    "ChainDrafter",
    "ChainDrafterConfig",
    "DraftContext",
    "DraftOutput",
    "Drafter",
    "DrafterConfig",
    "NullDrafter",
    "SequentialHead",
    "check_drafter_target",
    "check_gamma",
    "load_block_drafter",
    "load_chain_drafter",
    "load_drafter",
]
