"""`python -m simcluster.cli COMMAND`: the same as `simcluster COMMAND`."""

from simcluster.cli import main

raise SystemExit(main())
