"""``python -m ms_deepseek.cli``: the same entry point as the ``ms-deepseek`` console script."""

import sys

from ms_deepseek.cli import main

sys.exit(main())
