"""`python -m deepinfer.entrypoints.cli ...`, the same as the `deepinfer` script."""

import sys

from deepinfer.entrypoints.cli import main

sys.exit(main())
