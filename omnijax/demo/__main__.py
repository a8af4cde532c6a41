"""`python -m omnijax.demo`: see `omnijax.demo`."""

import sys

from omnijax.demo import main

if __name__ == "__main__":
    sys.exit(main())
