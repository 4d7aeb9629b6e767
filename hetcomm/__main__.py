import sys

from hetcomm.cli.main import main

sys.exit(main())
