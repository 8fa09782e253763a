import sys

from speclens.app.launcher import main

sys.exit(main())
