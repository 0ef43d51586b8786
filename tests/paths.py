"""Where the real data lives: ../shared/data beside the repo, or $VLCURATE_SHARED_DATA.
One rule for the tests (which skip without it) and the benchmark scripts."""
import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = Path(os.environ.get("VLCURATE_SHARED_DATA", REPO.parent / "shared" / "data"))
