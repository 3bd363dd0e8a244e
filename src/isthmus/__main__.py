"""`python -m isthmus` is the `isthmus` command."""

import sys

from isthmus.cli import main

sys.exit(main())
