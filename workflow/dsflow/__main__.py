import sys

from dsflow.cli import main

sys.exit(main())
