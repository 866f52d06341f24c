"""`python -m logitless ...` is `logitless ...`."""

import sys

from logitless.cli import main

sys.exit(main())
