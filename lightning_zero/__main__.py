"""``python -m lightning_zero``: the ``lightning-zero`` command."""

import sys

from lightning_zero.cli import main

sys.exit(main())
