import sys

from kvforensics.cli import main

sys.exit(main())
