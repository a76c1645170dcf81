import sys

from rebalancer.cli import main

sys.exit(main())
