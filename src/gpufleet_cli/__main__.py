import sys

from gpufleet_cli.cli import main

sys.exit(main())
