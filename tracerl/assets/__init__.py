"""Assets: prompts and skills as named, versioned texts in the store, applied by the gateway
to an unchanged agent's calls, measured by paired comparison, optimized from traces, and
internalized into the weights by a curriculum.

- records.py: what the store keeps (Asset, Comparison, Optimization) and NAME@v references;
- apply.py: the text put into a request's system message;
- stats.py: paired outcomes, repairs and regressions, exact McNemar and a bootstrap;
- config.py: torch-free settings (how the gateway applies one, the training curriculum);
- compare.py: the two arms of a comparison, run on the same tasks and seeds;
- proposers.py and optimize.py: candidate revisions and the search over them;
- curriculum.py: the asset given to each training rollout with a decaying probability.

Importing this package loads records only; the rest load when used.
"""

from tracerl.assets.records import (
    ASSET_NAME,
    Asset,
    AssetRef,
    Candidate,
    Comparison,
    Optimization,
    OptimizationRound,
    Pair,
)

__all__ = [
    "ASSET_NAME",
    "Asset",
    "AssetRef",
    "Candidate",
    "Comparison",
    "Optimization",
    "OptimizationRound",
    "Pair",
]
