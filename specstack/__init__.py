"""specstack: lossless hierarchical speculative decoding for long-context LLMs.

The pieces, lowest first: a :class:`Drafter` proposes tokens with their probabilities; a
:class:`CachePolicy` decides what a level attends to; a :class:`Verifier` accepts or rejects; a
:class:`SpeculativeLevel` composes them and is itself a drafter; a :class:`SpeculationStack` decodes
from the top level. Components are found by name through a :class:`Registry`.
"""

from .drafters import Drafter, LookupFirstDrafter, MergedDrafter, ModelDrafter, PromptLookupDrafter
from .errors import SpecstackError
from .model import CachedModel, CausalLM, KVCache
from .policies import CachePolicy, CacheState, EvictionPolicy, FullCache, GatheringPolicy, StreamingLLM
from .recipes import StackRecipe
from .retrieval import Retrieval
from .registry import Kind, Registry
from .sampling import SamplingConfig, sample, warp
from .stack import Level, SpeculationStack, SpeculativeLevel
from .types import Capability, Draft, GenerationResult, LevelStats, Verdict
from .verify import BlockVerifier, GreedyVerifier, SpeculativeSamplingVerifier, Verifier

__all__ = [
    "BlockVerifier", "CachePolicy", "CacheState", "EvictionPolicy", "GatheringPolicy", "CachedModel", "Capability", "CausalLM", "Draft", "Drafter", "FullCache",
    "GenerationResult", "GreedyVerifier", "KVCache", "Kind", "Level", "LevelStats", "LookupFirstDrafter", "MergedDrafter", "ModelDrafter",
    "PromptLookupDrafter", "Registry", "Retrieval", "SamplingConfig", "SpecstackError", "SpeculationStack",
    "SpeculativeLevel", "SpeculativeSamplingVerifier", "StackRecipe", "StreamingLLM", "Verdict", "Verifier",
    "sample", "warp",
]
