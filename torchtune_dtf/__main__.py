"""``python -m torchtune_dtf ls | cp | run`` (:mod:`torchtune_dtf._cli`)."""

import sys

from torchtune_dtf._cli import main

sys.exit(main())
