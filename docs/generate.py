"""Write the generated pages (config fields, commands, deployments, MLflow, the results ledger, the current
results) and README's "What you get" table.

    python docs/generate.py          # rewrite the pages that changed
    python docs/generate.py --check  # exit 1, listing them, when any is stale (what the build and a test do)
"""

import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent / "_ext"), str(Path(__file__).resolve().parents[1])]

from aiayn_docs import reference  # noqa: E402


def main(argv: list[str]) -> int:
    if "--check" in argv:
        stale = reference.stale()
        for page in stale:
            print(f"stale: {page} (run python docs/generate.py)", file=sys.stderr)
        return 1 if stale else 0
    for path in reference.write_all():
        print(f"wrote {path.relative_to(reference.REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
