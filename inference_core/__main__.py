"""`python -m inference_core ...`: see inference_core/cli.py."""

import sys

from inference_core.cli import main

sys.exit(main())
