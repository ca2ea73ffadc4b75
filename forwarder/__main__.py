import sys

from forwarder.cli import main

sys.exit(main())
