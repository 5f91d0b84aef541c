"""What the stages share and none of them is: user-facing errors, atomic files and content hashes, child processes,
the hardware's description, the C heap, the code graph behind cache keys, a run's commit, URLs shown without their
credentials, and the options that left the product. Imports nothing else of the pipeline, so every stage may import
it."""

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]  # the checkout: configs/, the code the cache keys hash, git
