"""`python -m omnijax.demo`: see `omnijax.demo`."""

import sys

from omnijax.demo import main

sys.exit(main())
