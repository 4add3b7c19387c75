"""``python -m kvarn.job``: kvarn's main job (``make run``)."""

from __future__ import annotations

from kvarn.job.steps import main

if __name__ == "__main__":
    raise SystemExit(main())
