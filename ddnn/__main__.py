"""`python -m ddnn` is the same as the `ddnn` console script."""

from ddnn.cli import main

raise SystemExit(main())
