import sys

from website.build import main

sys.exit(main())
