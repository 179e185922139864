"""The peer comparison alone: ``minipaged serve`` vs ``transformers serve --continuous-batching``.

    python bench/peer.py                 # both servers, SmolLM2, three request rates; updates docs/tuning.json
                                         # and docs/performance.md's peer section (bench/tuning.py runs it too)

Both servers load the same local folder, run one after the other on the same torch threads, and get the same
text prompts through ``minipaged bench serve``; the comparison is ``minipaged.bench.peer``.
"""
from __future__ import annotations

import sys

from minipaged.bench import peer
from minipaged.bench.walkthrough import main

if __name__ == "__main__":
    sys.exit(main({"peer": peer.run}, __doc__))
