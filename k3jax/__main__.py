"""`python -m k3jax ...`: the `k3jax` command line (k3jax/cli.py) without the installed script."""

import sys

from k3jax.cli import main

sys.exit(main())
