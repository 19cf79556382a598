"""`python -m dflash.cli` (and `torchrun -m dflash.cli`) is `dflash-train`."""

import sys

from dflash.cli import main

sys.exit(main())
