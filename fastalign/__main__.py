"""``python -m fastalign ...`` is ``fastalign ...`` (so ``torchrun -m fastalign train ...`` works too)."""

import sys

from fastalign.cli.main import main

sys.exit(main())
