"""`python -m deepinfer.cli ...`, the same as the `deepinfer` script."""

import sys

from deepinfer.cli import main

sys.exit(main())
