"""``python -m experiments.actfirst_alfworld``: the main job (see the package docstring)."""
import os
import sys

from . import main

if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
